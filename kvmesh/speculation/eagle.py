"""An EAGLE-style draft head: drafts from the target model's own hidden states.

The head is one small residual block that maps (the target's feature at position t,
the embedding of the token at t+1) to a predicted feature for t+1; the target's own
LM head turns that into next-token logits. Drafting k tokens runs it k times, feeding
its predicted feature and its own greedy token back in (EAGLE-1's feature
autoregression), starting from the target's feature of the last verified position
(``Sequence.feature``, filled by the engine for a proposer that ``wants_features``).

That first feature is the target's final hidden state, or (EAGLE-3 style, a head with
``feature_layers``) the outputs of a low, a middle and a high layer of the target,
concatenated, which the head fuses into one feature (``FeatureFusion``): the middle
layers carry more about the tokens after the next than the last one does.

The target's embedding and LM head are reused, frozen, and never stored in the head's
folder: only the block's weights are, plus the draft vocabulary (the ids the head may
propose: the most frequent ones of its training data, so a draft step costs a
576 x 8192 product, not 576 x 49152) and the target's fingerprint. Loading a head
against any other target raises ``InvalidArgument``.

Folder layout: ``config.json`` (format, sizes, target, how it was trained) and
``head.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.small_rows_linear import best_seconds, use_small_rows_linears
from kvmesh.engine.sampler import filter_probs
from kvmesh.errors import InvalidArgument

if TYPE_CHECKING:
    from kvmesh.engine.model import CausalLM
    from kvmesh.engine.sequence import Sequence
    from kvmesh.sampling import SamplingParams
    from kvmesh.speculation.drafter import DraftProposer

FORMAT = "kvmesh-eagle-v1"


class SampledDrafts(list):
    """Draft tokens sampled from distributions ``probs`` [k, V] (the engine verifies them with
    the full rejection rule); a plain list of ints to everything else."""

    probs: torch.Tensor


def target_fingerprint(model: CausalLM, vocab_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> str:
    """Identity of what the head was trained against: the config and the weights it reads
    (the embedding, the final norm and the LM head), in float32 so the serving dtype of a
    bf16 checkpoint does not change it. ``vocab_weights``: ``model.whole_vocab_weights()``, already read."""
    d = hashlib.blake2b(digest_size=16)
    d.update(json.dumps(model.cfg.raw, sort_keys=True, default=str).encode())
    # The whole vocabulary's, however many ranks share it.
    embedding, head = vocab_weights if vocab_weights is not None else model.whole_vocab_weights()
    tensors = [embedding, model.norm]
    if model.lm_head is not None:
        tensors.append(head)
    for t in tensors:
        d.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return d.hexdigest()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    # The target's layers whose outputs make the first feature (ascending); empty: its final hidden state.
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        layers = tuple(self.feature_layers)
        if list(layers) != sorted(set(layers)) or any(i < 0 for i in layers):
            raise InvalidArgument(f"feature_layers must be distinct ascending layer indices, not {list(layers)}")
        object.__setattr__(self, "feature_layers", layers)

    def check_target_layers(self, num_layers: int) -> None:
        """InvalidArgument when a feature layer is past a target of ``num_layers`` layers."""
        if self.feature_layers and self.feature_layers[-1] >= num_layers:
            raise InvalidArgument(f"feature_layers {list(self.feature_layers)} past the target's {num_layers} layers")


class FeatureFusion(nn.Module):
    """The target's layer outputs [.., n * h] -> one feature [.., h]: each layer's output
    RMS-normed on its own (their scales differ by orders of magnitude), then one projection."""

    def __init__(self, layers: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.layers, self.hidden, self.eps = layers, hidden, eps
        self.norm = nn.Parameter(torch.ones(layers, hidden))
        self.fc = nn.Linear(layers * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(*x.shape[:-1], self.layers, self.hidden)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        return self.fc(x.flatten(-2))


class EagleBlock(nn.Module):
    """(feature_t, embedding of token t+1) -> predicted feature_{t+1} (in the LM head's input space)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.feature_norm = RMSNorm(h, eps)
        self.embed_norm = RMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.mlp_norm = RMSNorm(h, eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.out_norm = RMSNorm(h, eps)
        n = len(cfg.feature_layers)
        self.fusion = FeatureFusion(n, h, eps) if n else None

    def first_feature(self, target_feature: torch.Tensor) -> torch.Tensor:
        """The target's feature as the first step's input: fused when it is several layers'."""
        return target_feature if self.fusion is None else self.fusion(target_feature)

    def forward(self, feature: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([self.feature_norm(feature), self.embed_norm(token_embedding)], dim=-1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        x = x + self.down(nn.functional.silu(gate) * up)
        return self.out_norm(x)


class EagleHead:
    """A trained block bound to its target's frozen embedding and LM head (draft vocabulary rows)."""

    def __init__(
        self, block: EagleBlock, embedding: torch.Tensor, lm_head: torch.Tensor, draft_vocab: torch.Tensor
    ) -> None:
        self.block = block.eval()
        self.feature_layers = block.cfg.feature_layers
        self.embedding = embedding.detach()
        self.draft_vocab = draft_vocab.to(torch.long)
        # The LM head's rows for the draft vocabulary, contiguous: one small product per draft step.
        rows = lm_head.detach()[self.draft_vocab].to(torch.float32).contiguous()
        self.draft_lm_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        self.draft_lm_head.weight = nn.Parameter(rows, requires_grad=False)
        if rows.device.type == "cpu":
            # A draft step multiplies one row a sequence, which MKL runs at half memory speed on
            # some processors (docs/measurements.md); the swap keeps MKL where the calibration
            # says it is the faster (kernels.small_rows_linear).
            modules = nn.ModuleList([self.block, self.draft_lm_head])
            use_small_rows_linears(modules)
            self.draft_lm_head = modules[1]
        self.vocab_size = lm_head.shape[0]

    @classmethod
    def load(cls, path: str | Path, model: CausalLM) -> EagleHead:
        from safetensors.torch import load_file

        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise InvalidArgument(f"{path} is not an EAGLE head folder (no config.json)")
        meta = json.loads(cfg_file.read_text())
        if meta.get("format") != FORMAT:
            raise InvalidArgument(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        vocab_weights = model.whole_vocab_weights()  # on a rank that holds a part: read once, here
        want, have = meta["target"]["fingerprint"], target_fingerprint(model, vocab_weights)
        if want != have:
            raise InvalidArgument(
                f"EAGLE head {path} was trained for another target model "
                f"({meta['target'].get('name', '?')}, fingerprint {want}); this target's fingerprint is {have}: "
                "train one for it with `kvmesh train-speculator`"
            )
        cfg = HeadConfig(**meta["head"])
        try:
            cfg.check_target_layers(model.cfg.num_layers)
        except InvalidArgument as e:
            raise InvalidArgument(f"{path}: {e}") from None
        block = EagleBlock(cfg)
        tensors = load_file(str(path / "head.safetensors"))
        draft_vocab = tensors.pop("draft_vocab")
        block.load_state_dict(tensors)
        return cls(block, *vocab_weights, draft_vocab)

    @torch.inference_mode()
    def sample(
        self, feature: torch.Tensor, token: int, k: int, params: SamplingParams, gen: torch.Generator
    ) -> SampledDrafts:
        """k drafts for one sampled request, each drawn from the head's distribution under the
        request's temperature / top-k / top-p / min-p; returned with those distributions [k, V]
        so verification can use the full rejection rule (``sampler.verify``)."""
        f = self.block.first_feature(feature.to(torch.float32).unsqueeze(0))
        tok = torch.tensor([token])
        out, probs = SampledDrafts(), []
        for _ in range(k):
            f = self.block(f, self.embedding[tok].to(torch.float32))
            logits = torch.full((self.vocab_size,), float("-inf"))
            logits[self.draft_vocab] = self.draft_lm_head(f)[0]
            q = filter_probs(logits, params)
            tok = torch.multinomial(q, 1, generator=gen)
            out.append(int(tok))
            probs.append(q)
        out.probs = torch.stack(probs)
        return out

    @torch.inference_mode()
    def draft(self, features: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy drafts [B, k] continuing each row: ``features`` [B, h] (with feature layers
        [B, n * h]) the target's feature of the position before ``tokens`` [B] (the last sampled
        token of each sequence)."""
        f = self.block.first_feature(features.to(torch.float32))
        tok = tokens.to(torch.long)
        out = []
        for _ in range(k):
            f = self.block(f, self.embedding[tok].to(torch.float32))
            tok = self.draft_vocab[self.draft_lm_head(f).argmax(dim=-1)]
            out.append(tok)
        return torch.stack(out, dim=1)

    def draft_seconds(self, k: int, repeats: int = 5) -> float:
        """Time to draft k tokens for one sequence (best of ``repeats``): what the engine adds to
        a verify's price (``kvmesh.speculation.verify_cost``)."""
        features = torch.zeros(1, self.block.cfg.hidden_size * max(1, len(self.feature_layers)))
        tokens = torch.zeros(1, dtype=torch.long)
        return best_seconds(repeats, lambda: self.draft(features, tokens, k))


class EagleProposer:
    """A ``DraftProposer`` (kvmesh.speculation.drafter) from an EAGLE head, in the decode process beside the target
    (placement (a): no hop; see docs/speculation.md for why it stays here)."""

    wants_features = True

    def __init__(self, head_path: str | Path, seed: int = 0) -> None:
        self.head_path = Path(head_path)
        self.head: EagleHead | None = None
        # Draws drafts for unseeded sampled requests (a seeded one draws with its own generator).
        self._gen = torch.Generator().manual_seed(seed)

    def bind(self, model: CausalLM) -> None:
        """Called by the engine once its target is loaded; refuses a head trained for another target."""
        self.head = EagleHead.load(self.head_path, model)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the head drafts from (empty: the final hidden state); known once bound."""
        return self.head.feature_layers if self.head is not None else ()

    def draft_seconds(self, k: int) -> float:
        """The head's time to draft k tokens for one sequence (0 before ``bind``)."""
        return self.head.draft_seconds(k) if self.head is not None else 0.0

    def draft(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Drafts for the sequences that have a feature (a request handed off from a prefill
        worker has none until its first step here): greedy requests' in one batch, greedy;
        sampled requests' drawn from the head's distribution, one request at a time."""
        ready = [(s, k) for s, k in wants if s.feature is not None and k > 0]
        if not ready or self.head is None:
            return {}
        out: dict[str, list[int]] = {}
        greedy = [(s, k) for s, k in ready if s.params.greedy]
        if greedy:
            features = torch.stack([s.feature for s, _ in greedy])
            tokens = torch.tensor([s.all_ids[-1] for s, _ in greedy])
            drafts = self.head.draft(features, tokens, max(k for _, k in greedy)).tolist()
            out.update({s.request_id: d[:k] for (s, k), d in zip(greedy, drafts)})
        for s, k in ready:
            if not s.params.greedy:
                gen = s.draft_generator or self._gen
                out[s.request_id] = self.head.sample(s.feature, s.all_ids[-1], k, s.params, gen)
        return out

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        return self.draft(wants)

    def finished(self, seq: Sequence) -> None:
        """Nothing to drop: the head keeps no per-request state (the feature lives on the sequence)."""


class RemoteWithHead:
    """A decode worker's drafts from both a speculator service and a local EAGLE head.

    The service's n-gram sources (the shared suffix index lives there) answer over the
    stream; the head runs here, beside the target (no hop for the features). The merge
    rule is the core's, split across the hop: a service started with
    ``--min-match-tokens N`` only answers with n-gram matches of at least N tokens (a
    repeated passage); where it has no answer, the head drafts. With the service down
    the remote side returns nothing at once, so decode keeps drafting with the head.
    """

    wants_features = True

    def __init__(self, remote: DraftProposer, head: EagleProposer) -> None:
        self.remote = remote
        self.head = head

    def bind(self, model: CausalLM) -> None:
        self.head.bind(model)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def draft_seconds(self, k: int) -> float:
        """Priced as the head's: the service's answers cost this thread nothing, but where it has
        none the head drafts."""
        return self.head.draft_seconds(k)

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        drafts = self.remote.propose(wants)
        rest = [(s, k) for s, k in wants if not drafts.get(s.request_id)]
        return {**drafts, **self.head.draft(rest)} if rest else drafts

    def finished(self, seq: Sequence) -> None:
        self.remote.finished(seq)
