"""Multi-LoRA serving: PEFT adapters over one base model, many in one batch.

- :mod:`.request`: ``LoRARequest``, how a request names its adapter (vLLM's interface).
- :mod:`.config`: ``LoRAConfig``, the ``--enable-lora`` family of flags.
- :mod:`.adapter`: a PEFT adapter folder read and checked against the base model.
- :mod:`.slots`: the adapters resident in the batch's slots and those kept loaded beyond them.
- :mod:`.layers`: the linear layers' LoRA products (the platform's ``LoRAKernels``).
- :mod:`.mapping`: each step's token -> slot mapping.
"""

from octavo.lora.request import LoRARequest

__all__ = ["LoRARequest"]
