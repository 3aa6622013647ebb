"""`shapeplan warm`: compile every planned shape through the trainer's real step before training.

model.py         frozen tasks, results and manifest records (no torch)
runner.py        plan -> tasks, manifest (skip and resume), per-shape accounting; takes a Backend and a Warmer
identity.py      what every warmer checks and loads alike: tokenizer, plan identity, the environment (manifest key)
trainer_loop.py  the trainer-loop warmer base: the real Trainer.train() loop on synthetic rows with fixed batches
sft.py           the SFT warmer; preference.py: the DPO, KTO and Reward warmers (both on trainer_loop.py)
rounds.py        the generation warm-up's rounds, planned without torch
generation.py    the GRPO/RLOO warmer; distillation.py: the Distillation warmer (on generation.py)
synthetic.py     synthetic rows whose collated batches have exactly a planned shape
opsig.py         records the ATen op signatures a run dispatches (what Neuron's eager cache is keyed on)
backends/        where compiled code goes and how to count compiles: Inductor (cpu/cuda), Neuron (lazy torch_neuronx)
"""
