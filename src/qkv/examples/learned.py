"""Example 9, learned attention: the article's W_Q, W_K, W_V found by gradient descent.

The first article designs its matrices by hand and then says that in a real model they are
trained, not designed. Here they are trained. Words keep the apple example's features
[verb, noun, food, tech]; the sentences are generated like the article's: an ambiguous noun
(苹果 or 小米, both half food and half tech) and a verb that decides its sense (吃, 煮, 切,
洗 for food; 发布, 收购, 升级 for tech), standing anywhere in the sentence, among up to two
other nouns of either sense (香蕉, 早餐, 手机, 芯片 ...) and function words (我, 他, 在 ...).

The model is one `qkv.MultiHeadAttention(4, 1, d_k=2, d_v=2)` layer, the article's sizes,
followed by a linear read-out of the ambiguous noun's output vector into food / tech. The
nouns carry a sense too, and W_V cannot keep the verb's food or tech while dropping a noun's
(both sit in the same two features), so the only way to the right answer is the article's
mechanism: the noun's query must find the verb's key. Training reaches it in a few hundred
steps of Adam on CPU; the learned matrices are then run through `qkv.reference` in float64
on the article's sentences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv import reference
from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, matrix_table, side_by_side, table
from qkv.examples.apple import FEATURES
from qkv.reference import Array, MultiHeadTrace

if TYPE_CHECKING:
    import torch

__all__ = ["Result", "SentenceReading", "TrainingConfig", "generate", "run"]

NAME = "learned"
TITLE = "Learned attention: gradient descent finds 'the noun looks for the verb'"
SUMMARY = (
    "One attention layer is trained to tell whether 苹果 / 小米 means food or tech from a verb "
    "anywhere in the sentence; its noun learns to put its weight on the verb."
)

SENSES = ("food", "tech")
# word kind -> (features over [verb, noun, food, tech], words)
KINDS: dict[str, tuple[tuple[float, ...], tuple[str, ...]]] = {
    "ambiguous": ((0.0, 1.0, 0.5, 0.5), ("苹果", "小米")),
    "food verb": ((1.0, 0.0, 1.0, 0.0), ("吃", "煮", "切", "洗")),
    "tech verb": ((1.0, 0.0, 0.0, 1.0), ("发布", "收购", "升级")),
    "food noun": ((0.0, 1.0, 1.0, 0.0), ("香蕉", "早餐", "厨房")),
    "tech noun": ((0.0, 1.0, 0.0, 1.0), ("手机", "电脑", "芯片")),
    "pronoun": ((0.0, 1.0, 0.0, 0.0), ("我", "他")),
    "function word": ((0.0, 0.0, 0.0, 0.0), ("今天", "在", "前", "了")),
}
VOCABULARY = tuple(word for _, words in KINDS.values() for word in words)
FEATURE_TABLE = np.array([KINDS[kind][0] for kind, (_, words) in KINDS.items() for _ in words])  # (V, 4)
KIND_OF = {word: kind for kind, (_, words) in KINDS.items() for word in words}

# The article's two sentences, and one whose other noun points the wrong way.
ARTICLE_SENTENCES = (("我", "吃", "苹果"), ("苹果", "发布", "手机"), ("他", "在", "电脑", "前", "吃", "小米"))


@dataclass(frozen=True)
class TrainingConfig:
    """How the layer is trained; the defaults take a few seconds on one CPU core."""

    seed: int = 0
    steps: int = 100
    batch_size: int = 64
    learning_rate: float = 0.02  # Adam; larger rates saturate the weights at exactly 0 and 1
    lengths: tuple[int, ...] = (3, 4, 5, 6, 7)  # sentence lengths, cycled step by step
    max_other_nouns: int = 2  # nouns of a random sense besides the ambiguous one
    eval_per_length: int = 200  # held-out sentences per length


@dataclass(frozen=True)
class Sentences:
    """A batch of generated sentences of one length.

    ids (N, L) into VOCABULARY; noun (N,) the position of the ambiguous noun; verb (N,) the
    position of the deciding verb; sense (N,) 0 = food, 1 = tech.
    """

    ids: np.ndarray
    noun: np.ndarray
    verb: np.ndarray
    sense: np.ndarray


def _pick(rng: np.random.Generator, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random words of one kind, as ids into VOCABULARY, in an array of ``shape``."""
    words = KINDS[kind][1]
    first = VOCABULARY.index(words[0])  # a kind's words are contiguous in VOCABULARY
    return first + rng.integers(0, len(words), size=shape)


def generate(rng: np.random.Generator, count: int, length: int, max_other_nouns: int) -> Sentences:
    """``count`` random sentences of ``length`` words (at least 2), in random order.

    Each has the ambiguous noun, one verb of a random sense, up to ``max_other_nouns`` nouns
    of random senses (independent of the verb's) and function words or pronouns for the rest.
    """
    rest = (count, length - 2)
    sense = rng.integers(0, 2, size=count)  # (N,)
    verbs = np.where(sense == 0, _pick(rng, "food verb", (count,)), _pick(rng, "tech verb", (count,)))  # (N,)
    fillers = np.where(
        rng.random(rest) < 0.4, _pick(rng, "pronoun", rest), _pick(rng, "function word", rest)
    )  # (N, L - 2)
    nouns = np.where(
        rng.integers(0, 2, size=rest) == 0, _pick(rng, "food noun", rest), _pick(rng, "tech noun", rest)
    )  # (N, L - 2)
    noun_count = rng.integers(0, max_other_nouns + 1, size=(count, 1))  # (N, 1)
    others = np.where(np.arange(length - 2) < noun_count, nouns, fillers)  # (N, L - 2)
    # before shuffling: slot 0 the ambiguous noun, slot 1 the verb, then the others
    slots = np.concatenate([_pick(rng, "ambiguous", (count, 1)), verbs[:, None], others], axis=1)  # (N, L)
    order = np.argsort(rng.random((count, length)), axis=1)  # a random permutation per sentence
    ids = np.take_along_axis(slots, order, axis=1)  # (N, L)
    # position i holds slot order[i]: find where slots 0 and 1 went
    return Sentences(ids=ids, noun=np.argmax(order == 0, axis=1), verb=np.argmax(order == 1, axis=1), sense=sense)


@dataclass(frozen=True)
class SentenceReading:
    """One sentence through the learned layer, in float64 with `qkv.reference`.

    trace: the layer's heads (1 head) and output (L, 4); noun_weights (L,) = the ambiguous
    noun's weights; probabilities (2,) = P(food), P(tech) read out from the noun's output.
    """

    tokens: tuple[str, ...]
    trace: MultiHeadTrace
    noun_weights: Array
    probabilities: Array


@dataclass(frozen=True)
class Result(ExampleResult):
    """Training curve, held-out accuracy and weight on the verb before and after, the learned
    matrices (reference layout: w_q, w_k (1, 4, 2), w_v (1, 4, 2), w_o (2, 4)) and the readings."""

    config: TrainingConfig
    vocabulary: tuple[str, ...]
    features: Array
    losses: Array
    accuracy_before: float
    accuracy_after: float
    verb_weight_before: float
    verb_weight_after: float
    w_q: Array
    w_k: Array
    w_v: Array
    w_o: Array
    b_q: Array
    b_k: Array
    b_v: Array
    b_o: Array
    readout_weight: Array  # (2, 4)
    readout_bias: Array  # (2,)
    module_difference: float  # max |module output (float32) - reference output (float64)|
    readings: tuple[SentenceReading, ...] = field(default=())

    def headline(self) -> str:
        return (
            f"held-out accuracy {fmt(100 * self.accuracy_before, 1)}% -> {fmt(100 * self.accuracy_after, 1)}%, "
            f"noun's weight on the verb {fmt(self.verb_weight_before)} -> {fmt(self.verb_weight_after)}"
        )

    def render(self) -> RenderableType:
        c = self.config
        progress = table(
            ["", "before training", "after training"],
            [
                ["held-out accuracy", f"{fmt(100 * self.accuracy_before, 1)}%", f"{fmt(100 * self.accuracy_after, 1)}%"],
                ["noun's mean weight on the verb", fmt(self.verb_weight_before), fmt(self.verb_weight_after)],
                ["training loss (cross-entropy)", f"{self.losses[0]:.3g}", f"{self.losses[-1]:.3g}"],
            ],
        )
        readings: list[RenderableType] = []
        for r in self.readings:
            noun = int(np.argmax([KIND_OF[t] == "ambiguous" for t in r.tokens]))
            sense = SENSES[int(np.argmax(r.probabilities))]
            readings.append(
                matrix_table(
                    f"{' '.join(r.tokens)}: {r.tokens[noun]} = {sense} (P = {r.probabilities.max():.4f})",
                    r.noun_weights[None, :],
                    [r.tokens[noun]],
                    list(r.tokens),
                )
            )
        axes = ["q1", "q2"]
        return Group(
            Text(
                f"{c.steps} Adam steps (lr {c.learning_rate}, batch {c.batch_size}, seed {c.seed}) on generated "
                f"sentences of {min(c.lengths)}-{max(c.lengths)} words",
                style="italic",
            ),
            progress,
            Text("Learned matrices (rows: features; compare with the apple example's designed ones)", style="italic"),
            side_by_side(
                matrix_table("W_Q", self.w_q[0], FEATURES, axes, digits=2),
                matrix_table("W_K", self.w_k[0], FEATURES, ["k1", "k2"], digits=2),
                matrix_table("W_V", self.w_v[0], FEATURES, ["v1", "v2"], digits=2),
            ),
            Text("The ambiguous noun's learned weights (float64, qkv.reference)", style="italic"),
            side_by_side(*readings),
            Text(
                f"qkv.MultiHeadAttention and qkv.reference agree to {self.module_difference:.1g} on these sentences.\n"
            ),
        )


class _Reader:
    """The trained model: attention layer, then a read-out of the ambiguous noun's output."""

    def __init__(self, seed: int) -> None:
        import torch

        from qkv.nn.multihead import MultiHeadAttention

        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)  # the initialization is part of the example's determinism
        self.attention = MultiHeadAttention(4, 1, d_k=2, d_v=2)
        self.readout = torch.nn.Linear(4, 2)
        torch.random.set_rng_state(generator_state)  # leave the caller's random stream alone
        self.features = torch.tensor(FEATURE_TABLE, dtype=torch.float32)  # (V, 4)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.attention.parameters(), *self.readout.parameters()]

    def __call__(self, ids: np.ndarray, noun: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits (N, 2), the noun's weights (N, L) and the layer's output (N, L, 4)."""
        import torch

        x = self.features[torch.as_tensor(ids)]  # (N, L, 4)
        out, weights = self.attention(x, return_weights=True)  # (N, L, 4), (N, 1, L, L)
        rows = torch.arange(len(ids))
        at_noun = torch.as_tensor(noun)
        return self.readout(out[rows, at_noun]), weights[rows, 0, at_noun], out  # (N, 2), (N, L)


class _Adam:
    """Adam (Kingma & Ba, 2015, Algorithm 1), written out.

    Not `torch.optim.Adam`: constructing a torch.optim optimizer imports torch._dynamo (the
    compiler stack; ``import torch`` alone does not), which costs several seconds, longer than
    this whole training run.
    """

    BETA1, BETA2, EPS = 0.9, 0.999, 1e-8  # the paper's defaults

    def __init__(self, parameters: list[torch.nn.Parameter], lr: float) -> None:
        import torch

        self.parameters, self.lr, self.t = parameters, lr, 0
        self.m = [torch.zeros_like(p) for p in parameters]  # first moment of the gradient
        self.v = [torch.zeros_like(p) for p in parameters]  # second moment

    def step(self) -> None:
        """Update every parameter from its .grad, then clear the gradients."""
        import torch

        self.t += 1
        with torch.no_grad():
            for p, m, v in zip(self.parameters, self.m, self.v, strict=True):
                assert p.grad is not None
                m.mul_(self.BETA1).add_(p.grad, alpha=1 - self.BETA1)
                v.mul_(self.BETA2).addcmul_(p.grad, p.grad, value=1 - self.BETA2)
                m_hat = m / (1 - self.BETA1**self.t)  # bias correction: m and v start at zero
                v_hat = v / (1 - self.BETA2**self.t)
                p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.EPS))
                p.grad = None


def _evaluate(model: _Reader, batches: list[Sentences]) -> tuple[float, float]:
    """(accuracy, mean weight of the noun on the verb) over held-out batches."""
    import torch

    correct = verb_weight = total = 0.0
    with torch.no_grad():
        for b in batches:
            logits, weights, _ = model(b.ids, b.noun)
            correct += float((logits.argmax(dim=1).numpy() == b.sense).sum())
            verb_weight += float(weights[np.arange(len(b.ids)), b.verb].sum())
            total += len(b.ids)
    return correct / total, verb_weight / total


def _as_float64(t: torch.Tensor) -> Array:
    return t.detach().double().numpy().copy()


def run(config: TrainingConfig | None = None) -> Result:
    """Train, evaluate before and after, and read the article's sentences with the result."""
    import torch

    config = config or TrainingConfig()
    threads = torch.get_num_threads()
    # Tensors of a few hundred numbers: one thread is faster than waking a pool for each op.
    torch.set_num_threads(1)
    try:
        return _train_and_read(config)
    finally:
        torch.set_num_threads(threads)


def _train_and_read(config: TrainingConfig) -> Result:
    import torch

    rng = np.random.default_rng(config.seed)
    held_out = [generate(rng, config.eval_per_length, n, config.max_other_nouns) for n in config.lengths]
    model = _Reader(config.seed)
    accuracy_before, verb_before = _evaluate(model, held_out)

    optimizer = _Adam(model.parameters(), config.learning_rate)
    losses = []
    for step in range(config.steps):
        batch = generate(rng, config.batch_size, config.lengths[step % len(config.lengths)], config.max_other_nouns)
        logits, _, _ = model(batch.ids, batch.noun)
        loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(batch.sense))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    accuracy_after, verb_after = _evaluate(model, held_out)

    # nn.Linear stores (out, in); the reference takes (in, out) per head.
    a = model.attention
    w_q = _as_float64(a.q_proj.weight).T[None]  # (1, 4, 2)
    w_k = _as_float64(a.k_proj.weight).T[None]  # (1, 4, 2)
    w_v = _as_float64(a.v_proj.weight).T[None]  # (1, 4, 2)
    w_o = _as_float64(a.out_proj.weight).T  # (2, 4)
    b_q, b_k, b_v = (_as_float64(p.bias)[None] for p in (a.q_proj, a.k_proj, a.v_proj))  # (1, 2)
    b_o = _as_float64(a.out_proj.bias)  # (4,)
    readout_weight, readout_bias = _as_float64(model.readout.weight), _as_float64(model.readout.bias)

    readings, difference = [], 0.0
    for tokens in ARTICLE_SENTENCES:
        ids = np.array([[VOCABULARY.index(t) for t in tokens]])  # (1, L)
        noun = int(np.argmax([KIND_OF[t] == "ambiguous" for t in tokens]))
        trace = reference.multi_head_attention(
            FEATURE_TABLE[ids[0]], w_q, w_k, w_v, w_o, b_q=b_q, b_k=b_k, b_v=b_v, b_o=b_o
        )
        logits = trace.output[noun] @ readout_weight.T + readout_bias  # (2,)
        probabilities, _ = reference.softmax(logits)
        with torch.no_grad():
            _, _, module_out = model(ids, np.array([noun]))
        difference = max(difference, float(np.abs(_as_float64(module_out[0]) - trace.output).max()))
        readings.append(SentenceReading(tokens, trace, trace.heads.weights[0, noun], probabilities))

    return Result(
        config=config,
        vocabulary=VOCABULARY,
        features=FEATURE_TABLE,
        losses=np.array(losses),
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        verb_weight_before=verb_before,
        verb_weight_after=verb_after,
        w_q=w_q,
        w_k=w_k,
        w_v=w_v,
        w_o=w_o,
        b_q=b_q,
        b_k=b_k,
        b_v=b_v,
        b_o=b_o,
        readout_weight=readout_weight,
        readout_bias=readout_bias,
        module_difference=difference,
        readings=tuple(readings),
    )
