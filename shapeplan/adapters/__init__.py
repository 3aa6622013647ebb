"""Adapters: TRL's parser and dataset preparation, datasets, tokenizers, accelerate's samplers, PEFT and the host,
turned into the plain values the planning core takes. Below the warm-up and the services; above only the core."""
