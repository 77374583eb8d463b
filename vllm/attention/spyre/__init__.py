"""Attention on Spyre: the FMS attention ops, their key/value layouts and
the native CPU kernels.

* ``static_cache``: static batching's ops over one cache per warm-up shape;
* ``paged_cache``: continuous batching's ops over a pool of blocks;
* ``paged_inputs``: the tensors of one paged step (``PagedInputs``);
* ``encoder_attention``: the ops of the encoders that pooling models run;
* ``torch_ops``: the attention the static and paged ops share, in torch ops;
* ``kv_layout``: cache and block-pool geometry and allocation;
* ``fms_registry``: registration of every op with FMS, once per process;
* ``native``: the C++ extension (``native_attention.cpp``,
  ``native_linear.cpp``) built on first use, with its ops' fake forms.
"""
