"""Multi-LoRA serving: adapters (PEFT folders) named by the request's `model`, batched per step.

    request.py   LoRARequest (name, id, path, content hash) and --lora-modules parsing (no torch)
    adapter.py   reads and checks a PEFT folder against the base model's shapes
    manager.py   the runner's side: adapters kept loaded (LRU), slots of a step, per-token index
    registry.py  the engine's side: the served adapters by name

The batched computation is engine/layers/lora.py.
"""
