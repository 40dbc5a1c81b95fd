"""Single-process references the tests compare against, written once and built independently of the
code under test: an attention mask from explicit loops (not ``GlobalMask``), attention from its
definition, and a plain-transformers training step on the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def allowed_reference(positions: torch.Tensor, valid: torch.Tensor, docs: bool, padding: bool,
                      window: int | None) -> torch.Tensor:
    """``(B, S, S)`` bool, by explicit loops over positions: causal, and with ``docs`` within the documents
    that ``positions`` ``(B, S)`` restart at 0, with ``padding`` only to ``valid`` ``(B, S)`` keys (a padding
    query sees itself alone), with ``window`` only to the last ``window`` keys."""
    B, S = positions.shape
    doc = [[sum(1 for t in range(1, i + 1) if positions[b, t] == 0) for i in range(S)] for b in range(B)]
    out = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for i in range(S):
            for j in range(S):
                ok = j <= i and (window is None or i - j < window)
                ok = ok and (not docs or doc[b][i] == doc[b][j]) and (not padding or bool(valid[b, j]))
                out[b, i, j] = (i == j) if padding and not valid[b, i] else ok
    return out


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    softcap: float | None = None) -> torch.Tensor:
    """(B,N,S,H) x (B,K,S,H) -> (B,S,N,H), the definition of attention (softmax in float64);
    ``allowed`` ``(B, S, S)`` bool."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(2, 3) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(scores.double(), -1).to(q.dtype) @ v).transpose(1, 2)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        allowed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float64 attention on the full sequence: ``o`` (B,S,N,H) and the grads of q, k, v for loss ``sum(o * g)``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = naive_attention(q, k, v, allowed)
    (o * g.double()).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


def document_starts(positions_S: torch.Tensor) -> list[int]:
    """``[0, ..., S]``: where the documents of one packed row (positions restarting at 0) start, and its end."""
    return (positions_S == 0).nonzero().flatten().tolist() + [positions_S.numel()]


def reference_step(model: torch.nn.Module, inputs: dict, labels: torch.Tensor, *, starts: list[int] | None = None,
                   sliced: tuple[str, ...] = ("input_ids",), checkpointing: bool = False,
                   **call_kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain transformers in one process: ``(loss, {name: grad})`` of ``model(**inputs, labels=labels)``.

    With ``starts`` (:func:`document_starts`, one packed row): each document ``[a, e)`` runs through the
    model on its own (the ``sliced`` inputs cut along their last dim), and the loss is the cross entropy
    of the concatenated logits, the truth a packed SP run must equal. ``checkpointing``: gradient
    checkpointing on, in train mode. ``call_kwargs`` go to every model call (e.g. ``use_cache=False``).
    """
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    if starts is None:
        loss = model(**inputs, labels=labels, **call_kwargs).loss
    else:
        logits = torch.cat([model(**{key: inputs[key][..., a:e] for key in sliced}, **call_kwargs).logits
                            for a, e in zip(starts[:-1], starts[1:])], 1)
        loss = F.cross_entropy(logits[0, :-1], labels[0, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}
