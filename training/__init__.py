"""Fine-tuning: the trainer (LoRA on the engine's device), its checkpoints, resume."""
