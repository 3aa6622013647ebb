"""`shapeplan warm`: compile every planned shape through the trainer's real step before training.

model.py      frozen tasks, results and manifest records (no torch)
runner.py     plan -> tasks, manifest (skip and resume), per-shape accounting; takes a Backend and a method warmer
synthetic.py  synthetic rows whose collated batches have exactly a planned shape
sft.py        the SFT warmer: the real SFTTrainer loop on synthetic rows
opsig.py      records the ATen op signatures a run dispatches (what Neuron's eager cache is keyed on)
backends/     where compiled code goes and how to count compiles: Inductor (cpu/cuda), Neuron (lazy torch_neuronx)
"""
