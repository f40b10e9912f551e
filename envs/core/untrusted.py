"""What the trainer accepts from an env server, which may be an image nobody here wrote (SECURITY.md's threat model).

One helper per concern, used by every client, probe, tool class and printer:
  * `loads_reply`: a reply frame or probe body parsed with caps on nesting and on lists and objects, both checked on
    the raw text in linear time before parsing (a deep or container-bomb reply is one line and costs milliseconds of
    the shared client loop that every env's sessions wait on);
  * `safe_text`: control and format characters escaped (no terminal escape, OSC 52 clipboard write, carriage return or
    invisible text reaches a terminal, a log or the model), chat-template tokens (`<|im_end|>`, `<tool_call>`)
    neutralised, and the text trimmed to a budget, cutting before escaping so a huge text costs little;
  * `strip_credentials`: userinfo and every query and fragment value removed from every URL that leaves the process;
  * `check_reward`: a reward is a finite number no larger than MAX_ABS_REWARD (JSON NaN/Infinity parse as floats, and a
    reward near 1e19 zeroes its group's advantages), else BadReward.
Frames are capped at MAX_REPLY_BYTES where they are read (envs.core.client, envs.core.probe).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from itertools import accumulate
from typing import Any

MAX_REPLY_BYTES = 1 << 20  # a reply frame (an observation): boards and texts are kilobytes
MAX_REPLY_DEPTH = 64  # as deep as the env servers accept actions (envs.core.server)
# Lists and objects per reply: a 900 KB board is ~100 and a 64-field schema ~70, while 1 MiB of `[]` is 349k, ~0.8 s
# to parse and walk (#44: 16 such replies held a benign env's step for 15.6 s).
MAX_REPLY_CONTAINERS = 20_000
MAX_ABS_REWARD = 1e6  # far above any env's scale; 1e15 dominates a group, 1e19 zeroes its advantages
TRIMMED = " …[trimmed]"


class UntrustedReply(ValueError):
    """An env's reply the trainer refuses (not JSON, nested too deep, not an object); the message is one line."""


class BadReward(ValueError):
    """A reward that is not a finite number within ±MAX_ABS_REWARD."""


# ---------------------------------------------------------------------------------------------- text
# C0 controls but tab and newline, DEL, C1 controls (0x9b is a one-byte CSI), and the Unicode bidi overrides that
# make a terminal show text in another order than it is (a forged reward).
_CONTROLS = [*(c for c in range(0x20) if c not in (0x09, 0x0A)), 0x7F, *range(0x80, 0xA0)]
_ESCAPES = {c: f"\\x{c:02x}" for c in _CONTROLS}
_ESCAPES.update({c: f"\\u{c:04x}" for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))})
# #44: every other format character (Unicode category Cf, as of Unicode 14/15: invisible, it hides text from a reader
# but not from the model; U+E0020-E007F tags spell invisible ASCII) and the line/paragraph separators.
_FORMAT = [0xAD, *range(0x600, 0x606), 0x61C, 0x6DD, 0x70F, 0x890, 0x891, 0x8E2, 0x180E, *range(0x200B, 0x2010),
           0x2028, 0x2029, *range(0x2060, 0x2065), *range(0x206A, 0x2070), 0xFEFF, *range(0xFFF9, 0xFFFC), 0x110BD,
           0x110CD, *range(0x13430, 0x13440), *range(0x1BCA0, 0x1BCA4), *range(0x1D173, 0x1D17B), 0xE0001,
           *range(0xE0020, 0xE0080)]
_ESCAPES.update({c: f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}" for c in _FORMAT})
# Chat-template markers an env text must not forge in the prompt (a tokenizer matches them inside any text, so
# `<|im_end|>` in an observation would end the tool turn): ChatML/Llama 3/GPT-OSS `<|...|>`, DeepSeek's fullwidth
# bars, tool and thinking tags, Mistral's [INST]-style markers; plus every added token of the run's tokenizer
# (register_tokens). Neutralised by swapping the opening bracket for a lookalike: shown, never matched.
_GENERIC_TOKENS = (r"<[|\uff5c][^<>\s]{1,64}?[|\uff5c]>|</?(?:tool_call|tool_response|tools|think|s|start_of_turn|"
                   r"end_of_turn|function_call|function_response)>|\[/?(?:INST|TOOL_CALLS|TOOL_RESULTS|"
                   r"AVAILABLE_TOOLS|SYSTEM_PROMPT)\]")
_tokens = re.compile(_GENERIC_TOKENS)
_OPENERS = {"<": "\u2039", "[": "\u2045"}  # ‹ and ⁅


def register_tokens(tokens: Any) -> None:
    """Also neutralise these exact strings (the model tokenizer's special and added tokens) in every env text."""
    global _tokens
    extra = {t for t in tokens if isinstance(t, str) and len(t) > 1}
    trie = _trie_pattern(t for t in extra if len(t) <= 200)
    longer = [re.escape(t) for t in sorted((t for t in extra if len(t) > 200), key=len, reverse=True)]
    _tokens = re.compile("|".join([*longer, *([trie] if trie else []), _GENERIC_TOKENS]))


def _trie_pattern(tokens: Any) -> str:
    """One regex for many exact strings, as a trie: at each position a character is compared once per branch point,
    not once per string (a plain alternation of Gemma-like 6,000 added tokens took 0.7 s over 4,000 `<`); the
    longest string wins, as in the sorted alternation it replaces. Recursion depth: a string's length (<= 200)."""
    root: dict = {}
    for token in tokens:
        node = root
        for ch in token:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return pattern(root)


def register_tokenizer(tokenizer: Any) -> None:
    """register_tokens with a transformers tokenizer's (or processor's) special and added tokens. Module state: every
    process that builds prompts calls it (the trainer, and ROLLOUTS=async's spawned rollout worker, which starts
    with none)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
    register_tokens([*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()])


def _neutralise(match: re.Match) -> str:
    token = match.group(0)
    opener = _OPENERS.get(token[0])
    return opener + token[1:] if opener else token[0] + "\u2060" + token[1:]  # escaped below: shown as \u2060


def escape_controls(text: str) -> str:
    """Control and format characters escaped (a terminal's or a log's view: a trace's own model turns keep their tags)."""
    return text.translate(_ESCAPES)


def neutralise_tokens(text: str) -> str:
    """Chat-template tokens made unmatchable (what the model is shown of an env's text)."""
    return _tokens.sub(_neutralise, text)


def safe_text(text: Any, limit: int | None = None) -> str:
    """`text` with control characters escaped, chat-template tokens neutralised, and at most `limit` characters (cut
    ones end in TRIMMED).

    Plain text within the limit comes back unchanged."""
    text = text if isinstance(text, str) else str(text)
    cut = limit is not None and len(text) > limit
    if cut:
        text = text[:limit]  # before escaping: escaping a 16 MiB text to show 2,000 characters is waste
    out = escape_controls(neutralise_tokens(text))
    if limit is not None and (cut or len(out) > limit):
        out = out[: max(0, limit - 13)] + TRIMMED
    return out


def one_line(text: Any, limit: int) -> str:
    """Whitespace runs (newlines too) folded to one space, controls escaped, at most `limit` characters (…)."""
    text = text if isinstance(text, str) else str(text)
    text = escape_controls(" ".join(text[: 4 * limit].split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------------------------- URLs
# The authority's userinfo ends at its LAST `@` (`wss://user:p@ss@host`: all of `user:p@ss`). After `user:` the
# password may hold an unencoded `/`, `?` or `#` (#63: `wss://u:p/ss@h` was shown whole), so it runs to the last `@`
# before whitespace or the next `://`; a port looks the same (`http://h:8000/a@b`) and is masked with it: more hidden,
# never less. Linear: a scheme is at most 32 characters, and no part is scanned past the next `://`.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]{0,31}://)(?:[^/?#\s@:]*:(?:(?!://)\S)*|[^/?#\s]*)@")
# A URL's query and fragment, to the next whitespace: every value there may be a credential (`?sid=`, `?jwt=`,
# `?code=`, `#access_token=`). A comma does not end it: a value may hold one (a following ENV_URLS entry is masked too).
_URL_TAIL = re.compile(r"(?i)(\b[a-z][a-z0-9+.\-]{0,31}://(?:[^?#\s:]|:(?!//))*)([?#]\S*)")
# Token-like values also where no scheme says it is a URL (`env-x:8000/ws?token=...` in a config value): a key (its
# run read once, possessive) whose name says so.
_QUERY_KEY = re.compile(r"([?&;][a-z0-9_.\-]*+=)([^&#;\s]*+)", re.IGNORECASE)
_SECRET_KEY = re.compile(r"(?i)token|key|secret|passw|pwd|auth|sig|credential|sid|jwt|code")
_TAIL_PART = re.compile(r"([?#&;])([^?#&;=]*)(=?)[^?#&;]*")


def _mask_secret_key(match: re.Match) -> str:
    return match.group(1) + "***" if _SECRET_KEY.search(match.group(1)) else match.group(0)


def _mask_tail(match: re.Match) -> str:
    # key=value -> key=***, a bare value (`#s3cret`) -> ***; empty parts and the keys stay (they say what was sent)
    return match.group(1) + _TAIL_PART.sub(
        lambda p: p.group(1) + (p.group(2) + "=***" if p.group(3) else "***" if p.group(2) else ""), match.group(2))


def strip_credentials(text: str) -> str:
    """Every URL in `text` without its userinfo (`user:password@` -> `***@`) and with every query and fragment value
    masked (`?token=s3cret&x=1#access_token=t` -> `?token=***&x=***#access_token=***`)."""
    return _QUERY_KEY.sub(_mask_secret_key, _URL_TAIL.sub(_mask_tail, _USERINFO.sub(r"\1***@", text)))


def log_text(text: str) -> str:
    """A message for a log or a terminal that may quote an env's text or a configured URL: controls escaped (newlines
    kept), no credentials."""
    return strip_credentials(escape_controls(text))


# ---------------------------------------------------------------------------------------------- JSON
def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether lists/dicts nest more than `limit` levels (iterative: any depth is safe to ask about)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


# Kept of a JSON text to find its structure: brackets, and the quotes that start and end strings.
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"')
_NESTING_STEP = [0] * 256
_NESTING_STEP[ord("[")] = _NESTING_STEP[ord("{")] = 1
_NESTING_STEP[ord("]")] = _NESTING_STEP[ord("}")] = -1


def outside_strings(data: bytes) -> bytes:
    """The brackets of JSON text `data` that are not inside a string, in order. Linear, in C calls only: a run of
    backslashes pairs off (`\\\\` is one escaped backslash), so the one left before a quote escapes it; with those
    quotes gone, every other quote opens a string and the next one closes it."""
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    return b"".join(data.split(b'"')[::2])


def check_shape(raw: str | bytes, max_depth: int = MAX_REPLY_DEPTH,
                max_containers: int = MAX_REPLY_CONTAINERS) -> None:
    """UntrustedReply when the JSON text `raw` holds more than `max_containers` lists and objects or nests deeper than
    `max_depth`. Linear in len(raw), on the text before parsing, with no Python loop per byte and no recursion:
    strings are cut out by a regex and all but brackets by bytes.translate (both C), then at most 2 * max_containers
    + 2 brackets are summed. Text that is not JSON may pass or fail here; json.loads says which."""
    brackets = raw.count(b"{") + raw.count(b"[") if isinstance(raw, bytes) else raw.count("{") + raw.count("[")
    if brackets <= min(max_depth, max_containers):  # neither cap reachable: most replies stop here
        return
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    data = outside_strings(data) if b'"' in data else data.translate(None, _NOT_BRACKETS)
    # The running sum over the first 2 * max_containers brackets: all of them when the container cap holds.
    if max(accumulate(map(_NESTING_STEP.__getitem__, data[: 2 * max_containers + 2])), default=0) > max_depth:
        raise UntrustedReply(f"a reply nested deeper than {max_depth} levels")
    containers = data.count(b"[") + data.count(b"{")
    if containers > max_containers:
        raise UntrustedReply(f"a reply with {containers:,} lists and objects, more than the {max_containers:,} "
                             "accepted")


def loads_reply(raw: str | bytes, max_depth: int = MAX_REPLY_DEPTH,
                max_containers: int = MAX_REPLY_CONTAINERS) -> Any:
    """Parse an env's JSON; UntrustedReply (one line) when it is not JSON, nests deeper than `max_depth` or holds more
    than `max_containers` lists and objects (check_shape, before parsing)."""
    check_shape(raw, max_depth, max_containers)
    try:
        return json.loads(raw)
    except RecursionError:  # not reached after check_shape; kept so a parse never ends in a traceback
        raise UntrustedReply(f"a reply nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # also an integer over Python's 4,300-digit limit, invalid UTF-8
        raise UntrustedReply(f"a reply that is not JSON ({one_line(exc, 120)})") from None


# ---------------------------------------------------------------------------------------------- rewards
def check_reward(value: Any) -> float:
    """`value` as a float, or BadReward saying why it is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadReward(f"reward {one_line(repr(value), 80)} is not a number")
    try:
        reward = float(value)
    except OverflowError:  # an int beyond float's range
        raise BadReward(f"reward {one_line(str(value), 40)} is out of range (±{MAX_ABS_REWARD:g})") from None
    if not math.isfinite(reward):
        raise BadReward(f"reward {reward} is not finite")
    if abs(reward) > MAX_ABS_REWARD:
        raise BadReward(f"reward {reward:g} is out of range (±{MAX_ABS_REWARD:g})")
    return reward
