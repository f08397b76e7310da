"""Token in, token out: how an environment's new messages join an episode's token stream.

The engine saw a stream of ids: the opening, its own sampled reply (ending with the
end-of-turn id it stopped on), and so on. Re-rendering the conversation with the chat
template does not give that stream back: templates strip earlier reasoning, trim content,
re-serialise values, and BPE merges differently where a reply's text meets what follows.
So the stream is never re-rendered. After a reply only a *bridge* is appended: what the
template writes after the reply's end-of-turn token (ChatML's "\\n") and the new messages,
up to the opened assistant turn. It is tokenized on its own, which is exact where it starts
right after a special token (the end-of-turn id): tokenizers split text at special tokens.

A bridge is sound only while the template writes the conversation so far as a prefix of
what it writes once the new messages are added. A template that rewrites earlier turns
(one that drops `<think>...</think>` from past assistant turns, say) fails that test: the
stream cannot continue as the template wants, and the episode is *split* (a new training
sample opens on the template's own rendering; titan_rl.rl.episodes). `rewrites_history()`
asks the template once, at start, with a probe conversation.

`rerendered(messages)` is the template's own rendering of the whole conversation, which the
loop compares with the stream to measure how often a re-render would have changed the
tokens (`rerender_divergence`), the size of the bug the bridge avoids.

Plain-text environments (a CharTokenizer, no template) join text: the new messages'
contents encoded and appended.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROBE = "titan-rl-reply-5c1e"
# A conversation whose earlier reply a history-rewriting template changes: reasoning inside
# <think> tags, and surrounding whitespace, which templates are known to strip.
_HISTORY_PROBE = [{"role": "user", "content": "q1"},
                  {"role": "assistant", "content": "<think>\nplan\n</think>\n\n answer one "},
                  {"role": "user", "content": "q2"}]


@dataclass
class Joined:
    """What a bridge gives after one reply: the ids to append (None: the template rewrote
    what it wrote before and the stream cannot continue; `restart` is the template's own
    rendering to open a new sample with), and the template's re-rendering of the whole
    conversation (None where there is no template)."""

    ids: list[int] | None
    restart: list[int] | None = None
    rerendered: list[int] | None = None


def bridge_for(tokenizer) -> "ChatBridge | PlainBridge":
    """The bridge of an environment's tokenizer: the chat template's where it has one."""
    return ChatBridge(tokenizer) if getattr(tokenizer, "has_chat_template", False) else PlainBridge(tokenizer)


class ChatBridge:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        hf = tokenizer.hf
        self.eot = tokenizer.end_of_turn_id
        self.eot_text = hf.decode([self.eot], skip_special_tokens=False)

    def _text(self, messages: list[dict], generation: bool) -> str:
        return self.tok.hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.hf.encode(text, add_special_tokens=False))

    def opening(self, opening) -> list[int]:
        """The first prompt's ids: ids as given, or messages rendered with the turn opened."""
        return list(opening) if _is_ids(opening) else self.tok.render(opening)

    def join(self, history: list[dict], reply_ids: list[int], reply_text: str, new: list[dict]) -> Joined:
        """After `reply` (sampled ids, decoded text) to the conversation `history`, the
        environment's `new` messages: the bridge ids to append to the stream, or a split."""
        conv = history + [{"role": "assistant", "content": reply_text}]
        closed, full = self._text(conv, False), self._text(conv + new, True)
        rerendered = self._ids(full)
        if not full.startswith(closed):  # the template rewrites what it wrote before
            return Joined(None, restart=rerendered, rerendered=rerendered)
        # what the template writes after a reply's content: its end-of-turn token, then a tail
        probe = self._text(history + [{"role": "assistant", "content": _PROBE}], False)
        after = probe[probe.rfind(_PROBE) + len(_PROBE):]
        if not after.startswith(self.eot_text):
            return Joined(None, restart=rerendered, rerendered=rerendered)
        ids = self._ids(after[len(self.eot_text):] + full[len(closed):])
        # a reply cut by its token budget (or ended by another stop id) did not sample the
        # end-of-turn token: the bridge writes it, as context
        lead = [] if reply_ids and reply_ids[-1] == self.eot else [self.eot]
        return Joined(lead + ids, rerendered=rerendered)

    def rewrites_history(self) -> bool:
        """Whether this template rewrites an earlier turn once a new message follows it."""
        closed = self._text(_HISTORY_PROBE[:2], False)
        return not self._text(_HISTORY_PROBE, True).startswith(closed)


class PlainBridge:
    """No chat template: the new messages' contents, encoded, appended to the stream."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def opening(self, opening) -> list[int]:
        if _is_ids(opening):
            return list(opening)
        bos = getattr(self.tok, "bos_id", None)
        return ([bos] if bos is not None else []) + self.tok.encode("".join(m["content"] for m in opening))

    def join(self, history, reply_ids, reply_text, new) -> Joined:
        return Joined(self.tok.encode("".join(m["content"] for m in new)))

    def rewrites_history(self) -> bool:
        return False


def _is_ids(opening) -> bool:
    return isinstance(opening, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in opening)
