"""A worker extension for tests (vLLM's ``worker_extension_cls``): vLLM
mixes it into the Spyre worker, and ``LLM.collective_rpc`` reaches its
methods on every rank."""
from __future__ import annotations


class ModelProbe:

    def spyre_probe(self) -> dict:
        """This rank, its model class, and a checksum of its weights."""
        model = self.model_runner.model
        total = sum(float(p.double().sum())
                    for p in model.fms_model.parameters())
        return dict(rank=self.rank, model=type(model).__name__,
                    weights_sum=total)
