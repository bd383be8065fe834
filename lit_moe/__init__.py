"""lit_moe: train DeepSeek-V3-style Mixture-of-Experts models with PyTorch Lightning from a MindFormers pynative.yaml."""

__version__ = "0.1.0"
