"""The sequence ranks' cut of a batch (accel/parallel/sequence_layout.py) and the whole-sequence masks
(accel/parallel/sequence.py), in one process: which tokens each rank holds, shifted labels, padding, refusals."""

import pytest
import torch

from accel.parallel.sequence import StepContext, documents_from_positions
from accel.parallel.sequence_layout import SequenceCutError, SequenceLayout, cut_batch, real_length


def test_contiguous_and_head_tail_layouts_cover_the_sequence_once():
    sp = [SequenceLayout(2, r, balanced=False).indices(8).tolist() for r in range(2)]
    assert sp == [[0, 1, 2, 3], [4, 5, 6, 7]]
    cp = [SequenceLayout(2, r, balanced=True).indices(8).tolist() for r in range(2)]
    assert cp == [[0, 1, 6, 7], [2, 3, 4, 5]]  # chunks r and 2n-1-r: equal causal work
    assert SequenceLayout(2, 0, True).gathered_indices(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    row = torch.arange(8)[None]
    assert SequenceLayout(2, 1, True).cut(row).tolist() == [[2, 3, 4, 5]]


def test_dict_batch_is_padded_and_cut_labels_unshifted():
    batch = {"input_ids": torch.arange(1, 7)[None], "labels": torch.arange(1, 7)[None]}
    mine = cut_batch(batch, SequenceLayout(2, 1, balanced=True), adds_positions=True)
    # length 6 padded to 8: rank 1 holds positions 2..5; labels cut as they are (the forward shifts them), -100 after
    # the end; the slices remember the real length
    assert mine["input_ids"].tolist() == [[3, 4, 5, 6]] and real_length(mine["input_ids"]) == 6
    assert mine["labels"].tolist() == [[3, 4, 5, 6]]
    assert mine["position_ids"].tolist() == [[2, 3, 4, 5]]
    assert mine["attention_mask"].tolist() == [[1, 1, 1, 1]]
    last = cut_batch(batch, SequenceLayout(2, 0, balanced=True), True)
    assert last["attention_mask"].tolist() == [[1, 1, 0, 0]] and last["labels"].tolist() == [[1, 2, -100, -100]]


def test_tuple_batches_are_cut_as_they_are_and_must_divide():
    x, y = torch.arange(8)[None], torch.arange(1, 9)[None]
    assert [t.tolist() for t in cut_batch((x, y), SequenceLayout(2, 0, False), True)] == [[[0, 1, 2, 3]],
                                                                                               [[1, 2, 3, 4]]]
    with pytest.raises(SequenceCutError, match="sequence length 6, which does not divide into 4 equal parts"):
        cut_batch((x[:, :6], y[:, :6]), SequenceLayout(2, 0, True), False)
    with pytest.raises(SequenceCutError, match="attention_mask has 4 dimensions"):
        cut_batch({"input_ids": x, "attention_mask": torch.ones(1, 1, 8, 8)}, SequenceLayout(2, 0, False), False)


def test_masks_are_causal_padded_and_per_document():
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    documents = documents_from_positions(positions)
    assert documents.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert documents_from_positions(torch.arange(6)[None]) is None
    padding = torch.tensor([[False, True, True, True, True, False]])  # one padding token at each end
    index = torch.arange(6)
    allowed = StepContext(6, padding, documents).allowed(index, index, causal=True)[0, 0]
    assert allowed[4].tolist() == [False, False, False, True, True, False]  # own document, causal, real keys
    assert allowed[0].tolist() == [True, False, False, False, False, False]  # left padding: itself only, never empty
