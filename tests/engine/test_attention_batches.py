"""A decode step's attention gives a sequence its bits alone, whatever its batch
(`invariant.RowByRow`, `step_order.flash`): batched in ATen's flash kernel where MKL runs
reproducibly, one sequence at a time where it may not (an AMD EPYC parted a row in a
batch from the same row alone at 2 threads without MKL's reproducible mode)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from offload.engine import invariant, step_order

SHAPES = [(2, 33), (5, 64), (9, 300)]  # (sequences, columns): one token each, 9 heads on 3


def _batch(rows: int, columns: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, 9, 1, 64, generator=generator)
    key = torch.randn(rows, 3, columns, 64, generator=generator)
    value = torch.randn(rows, 3, columns, 64, generator=generator)
    mask = torch.zeros(rows, 1, 1, columns, dtype=torch.bool)
    for row in range(rows):  # (each sequence its own length, as a step's rows)
        mask[row, ..., : 1 + (row * 7 + columns // 2) % columns] = True
    return query, key, value, mask


def parted_rows() -> list[tuple[int, int, int]]:
    """The (sequences, columns, row) whose attention in a batch, under `RowByRow`, is not
    that row's attention alone (its own tensors, not views of the batch's)."""
    parted = []
    for rows, columns in SHAPES:
        query, key, value, mask = _batch(rows, columns, seed=rows)
        with invariant.RowByRow():
            together = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, enable_gqa=True
            )
        for row in range(rows):
            alone = F.scaled_dot_product_attention(
                *(x[row : row + 1].clone() for x in (query, key, value)),
                attn_mask=mask[row : row + 1].clone(),
                enable_gqa=True,
            )
            if not torch.equal(together[row : row + 1], alone):
                parted.append((rows, columns, row))
    return parted


def test_a_sequence_attends_in_a_batch_as_alone():
    assert parted_rows() == []


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_importing_the_package_first_puts_mkl_in_its_reproducible_mode():
    """The default: batches attend in one call (no split), reproducibly."""
    assert step_order.mkl_reproducible()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_a_batch_is_split_where_mkl_ran_before_the_package_was_imported():
    """A program that made an MKL product before importing the package cannot have MKL's
    mode set any more: its batches are attended one sequence at a time, and still give a
    sequence's bits alone."""
    env = {key: value for key, value in os.environ.items() if key != "MKL_CBWR"}
    code = (
        "import sys, torch; torch.randn(64, 64) @ torch.randn(64, 64); "
        f"sys.path.insert(0, {os.path.dirname(__file__)!r}); "
        "import test_attention_batches as t; from offload.engine import step_order; "
        "print(step_order.mkl_reproducible(), t.parted_rows())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False []"
