"""Support for the tests and the benchmarks of the Spyre backend.

Both import it by name (it is installed with the development extra, see
``scripts/setup.sh``); neither imports the other's modules.  Nothing here
imports torch, transformers or vLLM at module level, so that a process can
set its environment before vLLM is first imported.

* ``paths``: the repository and the provisioned models;
* ``envs``: the Spyre settings of each backend and mode;
* ``engines``: ``vllm.LLM`` engines built under those settings, one kept
  alive between tests that ask for the same one, and greedy helpers;
* ``reference``: Hugging Face transformers' greedy reference;
* ``tiny_models``, ``tiny_encoders``, ``tiny_quantized``: tiny random
  checkpoints built at session start;
* ``server``, ``soak``: a real ``vllm serve`` on loopback, its metrics, and
  the burst and soak clients;
* ``quantized_reference``: the float model a quantized checkpoint
  stands for;
* scripts run in their own process: ``engine_start``,
  ``torchrun_generate``; classes named by qualified name in worker
  processes: ``plain_cpu_worker``, ``worker_extension``.
"""
