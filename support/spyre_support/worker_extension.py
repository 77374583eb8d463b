"""A worker extension for tests (vLLM's ``worker_extension_cls``): vLLM
mixes it into the Spyre worker, and ``LLM.collective_rpc`` reaches its
methods on every rank."""
from __future__ import annotations


class ModelProbe:

    def spyre_probe(self) -> dict:
        """This rank, its model class, and a checksum of its weights (the
        parameters, and the buffers that hold packed linear weights)."""
        model = self.model_runner.model
        fms = model.code.fms_model
        tensors = [*fms.parameters(), *fms.buffers()]
        total = sum(float(t.double().sum()) for t in tensors
                    if t.is_floating_point())
        return dict(rank=self.rank, model=type(model).__name__,
                    weights_sum=total)
