"""Synthetic jagged data: deterministic from the seed, valid offsets, length and popularity shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.config import ModelConfig, get_config
from models.data import SyntheticJaggedDataset, SyntheticSequences, length_sample, make_loader


def test_deterministic_and_seed_dependent():
    cfg = get_config("tiny")
    a, b = SyntheticJaggedDataset(cfg).batch(3), SyntheticJaggedDataset(cfg).batch(3)
    c = SyntheticJaggedDataset(cfg.replace(seed=1)).batch(3)
    assert torch.equal(a.items, b.items) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.items[: len(c.items)], c.items[: len(a.items)])


def test_jagged_layout_is_consistent():
    cfg = get_config("tiny", batch_size=6)
    batch = SyntheticJaggedDataset(cfg).batch(0)
    off = batch.seq_offsets
    assert off[0] == 0 and off[-1] == batch.num_tokens and len(off) == 7
    assert (off[1:] - off[:-1]).tolist() == batch.lengths
    for s, e in zip(off[:-1].tolist(), off[1:].tolist(), strict=True):
        assert batch.positions[s:e].tolist() == list(range(e - s))
        assert batch.prev_actions[s] == 0  # no action before the first event
    assert batch.labels.shape == (batch.num_tokens, cfg.num_tasks)
    assert int(batch.items.max()) < cfg.num_items and int(batch.prev_actions.max()) < cfg.num_actions


def test_length_distributions():
    base = get_config("tiny", max_seq_len=1024, min_seq_len=8)
    lengths = {}
    for dist in ("full", "uniform", "heavy_tailed"):
        gen = SyntheticSequences(base.replace(length_dist=dist))
        lengths[dist] = np.array([len(gen[i].items) for i in range(300)])
        assert lengths[dist].min() >= 8 and lengths[dist].max() <= 1024
    assert (lengths["full"] == 1024).all()
    assert 400 < np.median(lengths["uniform"]) < 620
    heavy = lengths["heavy_tailed"]
    assert np.median(heavy) < 200 < heavy.max() and heavy.mean() > np.median(heavy)


def test_zipf_popularity_and_label_depends_on_history():
    cfg = get_config("tiny", max_seq_len=512, min_seq_len=512, label_noise=0.0)
    gen = SyntheticSequences(cfg)
    sample = gen[0]
    ranks = sample.items // cfg.num_categories
    assert (ranks == 0).mean() > 5 * (ranks == 10).mean()  # rank 0 items are far more popular
    # Click is exactly "category in the user's taste": the taste categories are the frequent ones.
    cats = sample.items % cfg.num_categories
    clicked = set(cats[sample.labels[:, 0] == 1].tolist())
    counts = np.bincount(cats, minlength=cfg.num_categories)
    assert clicked == set(np.argsort(counts)[-cfg.taste_size :].tolist())


def test_loader_order_independent_of_workers():
    cfg = get_config("tiny")
    serial = [b.items for b in make_loader(cfg, 4, workers=0)]
    parallel = [b.items for b in make_loader(cfg, 4, workers=2)]
    assert len(serial) == 4 and all(torch.equal(a, b) for a, b in zip(serial, parallel, strict=True))


def test_lengths_file_drives_the_batches_and_the_tuning_tasks(tmp_path):
    """length_dist="file": batch lengths are draws from the file (raised to min_seq_len), and the graph tasks
    of the same config draw from the same lengths; a bad file or a missing pairing names the field."""
    import json

    import pytest

    from autotune.tuning import graph_tasks as gt
    from models.data import length_sample

    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"2": 5, "20": 3, "31": 1}))
    cfg = get_config("tiny", length_dist="file", lengths_file=str(path))
    assert cfg.distribution is None  # dispatch matches each batch by its fill
    assert cfg.replace(attention_hint="jagged").distribution == "jagged"  # pinned by the user
    assert get_config("tiny", length_dist="full").distribution == "uniform"
    drawn = length_sample(cfg, 300)
    assert set(drawn) == {cfg.min_seq_len, 20, 31}
    batch = SyntheticJaggedDataset(cfg).batch(0)
    assert set(batch.lengths) <= {cfg.min_seq_len, 20, 31} and len(batch.lengths) == cfg.batch_size
    assert set(gt.config_length_sample(cfg.to_dict())) == {cfg.min_seq_len, 20, 31}
    for overrides, match in (
        (dict(length_dist="file"), "go together"),
        (dict(lengths_file=str(path)), "go together"),
        (dict(length_dist="file", lengths_file=str(tmp_path / "none.json")), "lengths_file .*none.json: no such file"),
        (dict(length_dist="file", lengths_file=str(path), max_seq_len=16), "31 tokens, above max_seq_len 16"),
    ):
        with pytest.raises(ValueError, match=match):
            get_config("tiny", **overrides)


def test_collate_needs_a_sample_and_takes_empty_sequences():
    """No samples: a ``ValueError`` that says so (numpy's "need at least one array to concatenate" before);
    empty sequences collate to zero rows with the samples' task count."""
    import pytest

    from models.data import Sample, collate_jagged

    with pytest.raises(ValueError, match="samples is empty"):
        collate_jagged([])
    empty = Sample(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3), np.float32))
    batch = collate_jagged([empty, empty])
    assert batch.lengths == [0, 0] and batch.seq_offsets.tolist() == [0, 0, 0] and batch.labels.shape == (0, 3)


def test_a_rewritten_lengths_file_is_read_again(tmp_path):
    """The lengths were cached per path string for the process: a file rewritten between two configs kept its
    old lengths (batches drawn from a sample no longer on disk, and a length above max_seq_len let through)."""
    import os

    import pytest

    path = tmp_path / "lengths.txt"
    path.write_text("8 9 10\n")
    cfg = get_config("tiny", length_dist="file", lengths_file=str(path))
    assert set(SyntheticJaggedDataset(cfg).batch(0).lengths) <= {8, 9, 10}
    path.write_text("20 21 22 23\n")
    os.utime(path, ns=(0, 10**9))  # another modification time even on a coarse clock
    assert set(SyntheticJaggedDataset(cfg).batch(0).lengths) <= {20, 21, 22, 23}
    path.write_text("64\n")
    with pytest.raises(ValueError, match="64 tokens, above max_seq_len 32"):
        get_config("tiny", length_dist="file", lengths_file=str(path))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("length_dist", "zipf", "length_dist must be one of"), ("num_categories", 0, "num_categories must be a positive"),
     ("taste_size", 100, r"taste_size \(100\) must be <= num_categories")],
)  # fmt: skip
def test_data_from_a_config_built_directly_names_its_bad_field(field, value, match):
    """A ModelConfig built without get_config/replace is not validated: an unknown length_dist drew heavy-tailed
    lengths without a word, others failed inside numpy (ZeroDivisionError, 'larger sample than population')."""
    cfg = ModelConfig(kernels="reference", **{field: value})
    with pytest.raises(ValueError, match=match):
        SyntheticJaggedDataset(cfg).batch(0)
    with pytest.raises(ValueError, match=match):
        length_sample(cfg, 3)
