"""Megatron-compatible data: indexed datasets, GPTDataset, blending, the DataModule, preprocessing and a
shipped corpus.

- :func:`build_datasets` — ``train_dataset.dataloader`` mapping → (train, valid, test).
- :class:`MegatronDataModule` — the LightningDataModule (imported lazily: it needs Lightning).
- :class:`IndexedDataset` / :class:`IndexedDatasetBuilder` — the ``.bin``/``.idx`` format.
- :class:`GPTDataset`, :class:`BlendedDataset` — Megatron's sample construction and blending.
- ``lit_moe.data.preprocess.main(argv)`` — the ``lit_moe preprocess`` command.
- ``builtin:austen`` as a ``data_path`` prefix — the shipped corpus (see ``corpus/README.md``).
"""

from lit_moe.data.blended import BlendedDataset, parse_blend
from lit_moe.data.gpt import GPTDataset, GPTDatasetConfig
from lit_moe.data.indexed import DatasetError, IndexedDataset, IndexedDatasetBuilder
from lit_moe.data.loader import build_datasets, parse_dataloader

__all__ = [
    "BlendedDataset", "DatasetError", "GPTDataset", "GPTDatasetConfig", "IndexedDataset",
    "IndexedDatasetBuilder", "MegatronDataModule", "build_datasets", "parse_blend", "parse_dataloader",
]


def __getattr__(name):
    if name == "MegatronDataModule":
        from lit_moe.data.datamodule import MegatronDataModule

        return MegatronDataModule
    raise AttributeError(f"module 'lit_moe.data' has no attribute {name!r}")
