"""Adapters to Transformers, Accelerate, the Trainer, TRL and DeepSpeed (the only modules importing them)."""
