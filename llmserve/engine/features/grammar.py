"""Structured output in the engine: one llguidance matcher per constrained request, kept in the
mirror beside its tokens, and the allowed-token masks the sampler applies.

The engine masks (not the scheduler) because with overlap scheduling a mask planned by the
scheduler would be a step late. A step's mask is filled on a worker thread while its forward
runs; grammars compile on the compile thread, off the step path (`start_compiles`,
`take_compiled`), cached by common/structured_output.py's key; a matcher with no allowed token
allows only EOS and is reported (`take_dead_ends`). The scheduler's side is
scheduler/grammar_wait.py. The design: docs/architecture.md#structured-output.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer

from llmserve.common.log import get_logger
from llmserve.common.step_plan import GrammarCompile
from llmserve.common.structured_output import constraint_of, grammar_text
from llmserve.common.tokenizer_files import load_tokenizer_files
from llmserve.engine.contract.mirror import PLACEHOLDER, ScheduledSeq, SeqState

log = get_logger("engine")

MAX_CACHED_GRAMMARS = 256

# The compile of a constraint that sets nothing: done, nothing to mask.
_NOTHING: Future[None] = Future()
_NOTHING.set_result(None)


@dataclass
class RowGrammar:
    """A request's matcher (SeqState.grammar): built from the compiled grammar on its first
    mask; num_consumed of its generated tokens fed to it so far."""

    compiled: Future[LLMatcher]
    matcher: LLMatcher | None = None
    num_consumed: int = 0
    dead: bool = False  # allowed nothing once: EOS only from then on


@dataclass
class MaskJob:
    """The masks of one step's constrained sampling positions, being filled on the mask thread:
    `result()` gives (positions, bitmask int32 [len(positions), words]) once done."""

    future: Future[tuple[list[int], np.ndarray]]

    def result(self) -> tuple[list[int], np.ndarray]:
        return self.future.result()


class Grammars:
    """The engine's grammar side: the vocabulary, the compiled-grammar cache, the threads."""

    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_words = (vocab_size + 31) // 32
        self._compile_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self.model_path = model_path
        # Built on the compile thread when the first constrained request comes (about a second
        # for a 50k vocabulary), so that engines never asked for structured output pay nothing.
        self._tokenizer: LLTokenizer | None = None
        # The library's EOS when the model's is not in the tokenizer (see _load_tokenizer).
        self._stand_in_eos: int | None = None
        self._cache: OrderedDict[tuple[str, str], Future[LLMatcher]] = OrderedDict()
        # Waiting requests' compiles (a plan's grammar_compiles) not reported yet, by seq id.
        self._pending: dict[int, Future[Any]] = {}
        # Requests whose grammar allowed no token since the last take_dead_ends (the mask thread
        # adds, the step loop takes).
        self._dead_ends: list[int] = []
        self._dead_lock = threading.Lock()
        # For bench/studies/structured_cpu.py: the masks filled (per row and step) and their time.
        self.num_masks = 0
        self.mask_s = 0.0

    def _load_tokenizer(self, path: Path) -> LLTokenizer:
        tokenizer = load_tokenizer_files(path).tokenizer
        # A shape served with random weights has the byte-level tokenizer: its EOS is past the
        # tokenizer's ids; the masks let it through where the grammar allows nothing else.
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = [t for t in self.eos_token_ids if t < size] or None
        loaded = LLTokenizer(tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        self._stand_in_eos = None if eos else loaded.eos_token
        return loaded

    def close(self) -> None:
        self._compile_thread.shutdown(wait=False, cancel_futures=True)
        self._mask_thread.shutdown(wait=False, cancel_futures=True)

    # -- compiling --------------------------------------------------------------------------------

    def attach(self, rows: list[ScheduledSeq]) -> None:
        """Give each constrained request of rows that has none its RowGrammar, its compile
        started (or found in the cache). Cheap for unconstrained rows: one field read."""
        for row in rows:
            seq = row.seq
            if seq.grammar is None and seq.sampling.HasField("structured_output"):
                key = constraint_of(seq.sampling.structured_output)
                if key is not None:
                    seq.grammar = RowGrammar(self.compiled(key))

    def start_compiles(self, compiles: list[GrammarCompile]) -> None:
        """Start compiling waiting requests' grammars on the compile thread (or find them in
        the cache), to be reported by take_compiled. Returns at once."""
        for item in compiles:
            key = constraint_of(item.structured_output)
            self._pending[item.seq_id] = _NOTHING if key is None else self.compiled(key)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_compiled(self, wait_s: float = 0.0) -> tuple[list[int], list[tuple[int, str]]]:
        """The started compiles that ended since the last call, forgotten here: (seq ids
        compiled, [(seq id, why)] for those that failed). wait_s: when none has ended yet, wait
        up to this long for the first (a step with nothing else to do)."""
        if wait_s and self._pending and not any(f.done() for f in self._pending.values()):
            wait(self._pending.values(), timeout=wait_s, return_when=FIRST_COMPLETED)
        compiled: list[int] = []
        refused: list[tuple[int, str]] = []
        for seq_id in [i for i, f in self._pending.items() if f.done()]:
            error = self._pending.pop(seq_id).exception()
            if error is None:
                compiled.append(seq_id)
            else:
                refused.append((seq_id, f"structured_output does not compile: {error}"[:500]))
        return compiled, refused

    def forget_pending(self) -> None:
        """Drop the unreported compiles (a new Step stream: its scheduler lists them again);
        the cache keeps what they compile."""
        self._pending.clear()

    def compiled(self, key: tuple[str, str]) -> Future[LLMatcher]:
        """The compiled grammar of key (a matcher in its start state, to copy), from the cache
        or compiling on the compile thread."""
        future = self._cache.get(key)
        if future is None:
            future = self._compile_thread.submit(self._compile, key)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def _compile(self, key: tuple[str, str]) -> LLMatcher:
        if self._tokenizer is None:  # only this thread builds it
            self._tokenizer = self._load_tokenizer(self.model_path)
        matcher = LLMatcher(self._tokenizer, grammar_text(*key), log_level=0)
        if matcher.is_error():  # the library refused the grammar
            raise ValueError(matcher.get_error().strip()[:400])
        return matcher

    # -- masking ----------------------------------------------------------------------------------

    def start_masks(self, rows: list[ScheduledSeq], host_tokens: Any = None) -> MaskJob | None:
        """Start filling the masks of rows' constrained sampling positions (each sampling row
        has 1 + len(draft_token_ids) positions, in row order) on the mask thread; None when no
        sampling row is constrained. host_tokens: a callable giving the previous step's
        sampled tokens on the host (a list by batch row), for requests whose newest token is
        still a placeholder; called on the mask thread."""
        self.attach(rows)
        work: list[tuple[int, ScheduledSeq]] = []
        position = 0
        for row in rows:
            if not row.samples:
                continue
            if row.seq.grammar is not None:
                work.append((position, row))
            position += 1 + len(row.draft_token_ids)
        if not work:
            return None
        return MaskJob(self._mask_thread.submit(self._fill, work, host_tokens))

    def _fill(
        self, work: list[tuple[int, ScheduledSeq]], host_tokens: Any
    ) -> tuple[list[int], np.ndarray]:
        t0 = time.perf_counter()
        previous: list[int] | None = None
        if host_tokens is not None and any(r.seq.token_ids[-1] == PLACEHOLDER for _, r in work):
            previous = host_tokens()
        positions: list[int] = []
        num = sum(1 + len(r.draft_token_ids) for _, r in work)
        bitmask = np.zeros((num, self.num_words), dtype=np.int32)
        at = 0
        for position, row in work:
            matcher = self._caught_up(row.seq, previous)
            for j in range(1 + len(row.draft_token_ids)):
                positions.append(position + j)
            at = self._fill_row(row, matcher, bitmask, at)
        self.num_masks += len(work)
        self.mask_s += time.perf_counter() - t0
        return positions, bitmask

    def _caught_up(self, seq: SeqState, previous: list[int] | None) -> LLMatcher | None:
        """seq's matcher after consuming its generated tokens (None: it cannot continue)."""
        state: RowGrammar = seq.grammar
        if state.dead:
            return None
        if state.matcher is None:
            try:
                state.matcher = state.compiled.result().deep_copy()
            except Exception as err:  # our gateway checked it compiles; another client may not
                self._dead(seq, "grammar does not compile", str(err))
                return None
        output = seq.token_ids[seq.num_prompt_tokens :]
        if output and output[-1] == PLACEHOLDER:
            assert previous is not None, f"seq {seq.seq_id}: placeholder without its step"
            output[-1] = previous[seq.pending_row]
        new = output[state.num_consumed :]
        state.num_consumed = len(output)
        for token in new:
            # A finished grammar (it took its EOS, or can take nothing more) ignores what
            # follows: an EOS, or with overlap the token computed after one, which is dropped.
            if state.matcher.is_stopped():
                break
            if not state.matcher.consume_token(token):
                self._dead(seq, "grammar refused a token", state.matcher.get_error()[:300])
                return None
        return state.matcher

    def _fill_row(
        self, row: ScheduledSeq, matcher: LLMatcher | None, bitmask: np.ndarray, at: int
    ) -> int:
        """Fill row's masks (one per position) from index at of bitmask; the next index.

            positions: | 0 | 1 | ... | d |    mask j: after consuming proposals [0, j)
            proposals:   p0  p1 ... p(d-1)   (rolled back once the masks are filled)

        A position after a proposal the grammar refuses allows everything: that proposal is
        rejected at its own position, so nothing sampled after it is kept."""
        drafts = row.draft_token_ids
        if matcher is None:
            for j in range(1 + len(drafts)):
                self._only_eos(bitmask[at + j])
            return at + 1 + len(drafts)
        num_valid = matcher.validate_tokens(drafts) if drafts else 0
        for j in range(1 + len(drafts)):
            if j > num_valid:
                bitmask[at + j] = -1
                continue
            self._fill_one(row.seq, matcher, bitmask[at + j])
            if j < num_valid:
                matcher.consume_token(drafts[j])
        if num_valid:
            matcher.rollback(num_valid)
        return at + 1 + len(drafts)

    def _fill_one(self, seq: SeqState, matcher: LLMatcher, out: np.ndarray) -> None:
        if matcher.is_stopped():  # the grammar is complete: only an EOS may follow
            self._only_eos(out)
            return
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        words = out.view(np.uint32)
        stand_in = self._stand_in_eos
        if stand_in is not None and words[stand_in // 32] >> np.uint32(stand_in % 32) & 1:
            # the library's EOS is not the model's (a byte-level stand-in): the model's instead
            words[stand_in // 32] &= ~np.uint32(1 << (stand_in % 32))
            self._allow_eos(words)
        if matcher.is_error() or not out.any():
            if not seq.grammar.dead:
                self._dead(seq, "grammar allows no token; ending with EOS", matcher.get_error())
            self._only_eos(out)

    def _dead(self, seq: SeqState, event: str, error: str) -> None:
        """seq's grammar can take no token from now on: EOS only, and reported once."""
        seq.grammar.dead = True
        log.warning(event, seq_id=seq.seq_id, error=error.strip().splitlines()[0] if error else "")
        with self._dead_lock:
            self._dead_ends.append(seq.seq_id)

    def take_dead_ends(self) -> list[int]:
        """The requests whose grammar reached a dead end since the last call, each once."""
        with self._dead_lock:
            taken, self._dead_ends = self._dead_ends, []
        return taken

    def _only_eos(self, out: np.ndarray) -> None:
        out[:] = 0
        self._allow_eos(out.view(np.uint32))

    def _allow_eos(self, words: np.ndarray) -> None:
        for token in self.eos_token_ids:
            if token < self.vocab_size:
                words[token // 32] |= np.uint32(1 << (token % 32))
