"""Filling a llama_batch (llama_cpp's ctypes struct) one token at a time, for every worker mode."""

from __future__ import annotations


def put_token(batch, i: int, token: int, pos: int, seq: int = 0, output: bool = True) -> None:
    """Token i of the batch: at position pos of sequence seq (that one alone), with its logits out or not."""
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = 1 if output else 0
