"""neuronx-cc of the fake (see torch_neuronx): only the version, which sync mode's compile path keys with
(kernels/compiler_subprocess.py reads `neuronxcc.__version__`). The one Neuron 2.33 ships."""

from importlib import metadata

__version__ = metadata.version("neuronx-cc")
