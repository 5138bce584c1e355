"""The object store every host reaches: file bytes, outputs, checkpoints, adapters."""
