"""Finetuning for generation (`gptc finetune`): prompt/response and continuation data, LoRA."""
