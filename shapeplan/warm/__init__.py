"""`shapeplan warm`: compile every planned shape through the trainer's real step before training.

model.py         frozen tasks, results and manifest records (no torch)
runner.py        plan -> tasks, manifest (skip and resume), per-shape accounting; takes a Backend and a Warmer
identity.py      what every warmer checks and loads alike: tokenizer, plan identity, the environment (manifest key)
trainer_loop.py  the trainer-loop warmer base: the real Trainer.train() loop on synthetic rows with fixed batches
trainer_setup.py what every warmer does to the TRL trainer it drives: its script config, fixed batches, run logs
sft.py           the SFT warmer; dpo.py, kto.py, reward.py: the preference warmers, on what preference.py holds for
                 them all (paired rows, the ref_precompute passes); all on trainer_loop.py
rounds.py        the generation warm-up's rounds, planned without torch
generation.py    the GRPO/RLOO warmer; distillation.py: the Distillation warmer (on generation.py)
synthetic.py     synthetic rows whose collated batches have exactly a planned shape
shards.py        how tasks are dealt to shards, workers and ranks (costliest first); parallel.py: the workers
manifest.py      the manifest files (read, merged, written atomically) and the machine's environment
tracker.py       accounts each task and reports it to the progress callback; cachedir.py: the cache dir warm writes
opsig.py         records the ATen op signatures a run dispatches (what Neuron's eager cache is keyed on)
backends/        where compiled code goes and how to count compiles: Inductor (cpu/cuda), Neuron (lazy torch_neuronx)
"""
