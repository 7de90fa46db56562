"""How the server writes a request's choices: logprobs in OpenAI's two forms (completions'
lists, chat's entries), the prompt's logprobs in vLLM's form, `echo`, tool calls and
usage. Plain functions of the tokenizer and the engine's Updates; the app streams or
returns what they make."""
from __future__ import annotations

from headwise.server import inputs
from headwise.server.engine_client import Update
from headwise.server.tool_calls import StreamParser, ToolPlan, parse as parse_tools
from headwise.tokenizer import Tokenizer


class Logprobs:
    """Token ids and logprobs written for clients, tokens decoded one by one."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def text(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False)

    def completion(self, upds: list[Update]) -> dict:
        """Completions' form: tokens, token_logprobs, top_logprobs (token text -> logprob)."""
        toks, lps, tops = [], [], []
        for u in upds:
            toks += [self.text(t) for t in u.token_ids]
            lps += u.logprobs
            tops += [{self.text(k): v for k, v in d.items()} for d in u.top_logprobs]
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops or None, "text_offset": None}

    def chat(self, upds: list[Update]) -> dict:
        """Chat's form: per token its text, logprob, bytes and top_logprobs."""
        content = []
        for u in upds:
            for i, t in enumerate(u.token_ids):
                s = self.text(t)
                top = u.top_logprobs[i] if i < len(u.top_logprobs) else {}
                content.append({"token": s, "logprob": u.logprobs[i], "bytes": list(s.encode()),
                                "top_logprobs": [{"token": self.text(k), "logprob": v,
                                                  "bytes": list(self.tok.decode([k]).encode())}
                                                 for k, v in top.items()]})
        return {"content": content}

    def prompt(self, ids: list[int], u0: Update) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {"<id>": {logprob,
        rank, decoded_token}} for the token itself and the top k there."""
        out: list[dict | None] = []
        for p, entry in enumerate(u0.prompt_logprobs):
            if entry is None:
                out.append(None)
                continue
            # The top k come first, in order; the prompt's own token last where not among them.
            out.append({str(t): {"logprob": v, "rank": u0.prompt_ranks[p] if t == ids[p] else r + 1,
                                 "decoded_token": self.text(t)}
                        for r, (t, v) in enumerate(entry.items())})
        return out

    def echo(self, ids: list[int], u0: Update, k: int) -> dict:
        """The echoed prompt's part of a completion's `logprobs`: its tokens, their logprobs
        (None for the first), and the top k at each."""
        lps = [None] + [u0.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))]
        tops = [None] + [{self.text(t): v for t, v in u0.prompt_logprobs[p].items()} for p in range(1, len(ids))]
        return {"tokens": [self.text(t) for t in ids], "token_logprobs": lps, "top_logprobs": tops if k else None,
                "text_offset": None}


def joined(a: dict, b: dict) -> dict:
    """Two completion logprobs objects, one after the other."""
    tops = None if a["top_logprobs"] is None and b["top_logprobs"] is None else \
        (a["top_logprobs"] or []) + (b["top_logprobs"] or [])
    return {"tokens": a["tokens"] + b["tokens"], "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": tops, "text_offset": None}


def total_usage(lasts: list[Update], starts: list[int], prompt_only: bool = False) -> dict:
    """Usage of a request from each choice's last update; `starts`: the index of each
    prompt's first choice. Each prompt counts once for all its choices (it is computed
    once), as OpenAI counts it."""
    out = 0 if prompt_only else sum(u.num_output_tokens for u in lasts)
    firsts = [lasts[s] for s in starts]
    prompt = sum(u.num_prompt_tokens for u in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": sum(u.num_cached_tokens for u in firsts)}}


class Reply:
    """How one prompt's choices are written: what leads each (`echo`, and on completions
    the echoed prompt's logprobs), whether the generated part is shown (max_tokens 0 with
    echo: it is not), the prompt's logprobs in vLLM's form where asked for, and tool
    calls. The prompt's logprobs come with choice 0's first update."""

    def __init__(self, lp: Logprobs, ids: list[int], req: inputs.GenerationRequest, chat: bool, echo: str,
                 asked_prompt_lp: bool, tools: ToolPlan | None) -> None:
        self.lp, self.ids, self.chat, self.echo = lp, ids, chat, echo
        # tool calls are parsed out of the reply (not for "none", whose tools were not shown)
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self.want_lp = req.params.logprobs is not None
        self.k = req.params.logprobs or 0
        self.echo_lp = not chat and bool(echo) and self.want_lp
        self.prompt_only = req.prompt_only
        self.asked_prompt_lp = asked_prompt_lp
        self.first: Update | None = None  # choice 0's first update (the prompt's logprobs)

    def see(self, i: int, u: Update) -> None:
        if i == 0 and self.first is None and u.prompt_logprobs is not None:
            self.first = u

    def lead(self) -> tuple[str, dict | None]:
        """The text and (completions) logprobs that start a choice."""
        lp = self.lp.echo(self.ids, self.first, self.k) if self.echo_lp and self.first else None
        return self.echo, lp

    def prompt_field(self) -> list | None:
        return self.lp.prompt(self.ids, self.first) if self.asked_prompt_lp and self.first else None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A chat choice's message (content and any tool calls) and its finish reason."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse_tools(text, self.tools)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.as_json() for c in calls]
            if finish_reason == "stop" and self.tools.mode != "named":  # OpenAI's reasons
                finish_reason = "tool_calls"
        return msg, finish_reason

    def body(self, upds: list[Update]) -> tuple[str, dict | None]:
        """A choice's generated text and logprobs (none with prompt_only)."""
        if self.prompt_only:
            empty = {"content": []} if self.chat else \
                {"tokens": [], "token_logprobs": [], "top_logprobs": None, "text_offset": None}
            return "", empty if self.want_lp else None
        text = "".join(u.text for u in upds)
        if not self.want_lp:
            return text, None
        return text, self.lp.chat(upds) if self.chat else self.lp.completion(upds)

    def tool_chunks(self, parser: StreamParser, i: int, u: Update) -> list[dict]:
        """A streamed chat choice's pieces when tools may be called: content as it is safe
        to send, the calls whole at the end."""
        lp = self.lp.chat([u]) if self.want_lp and u.token_ids else None
        out = []
        text = parser.feed(u.text)
        if text or lp:
            out.append({"index": i, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": None})
        if u.finished:
            rest, calls = parser.finish()
            delta: dict = {"content": rest} if rest else {}
            if calls:
                delta["tool_calls"] = [dict(c.as_json(), index=j) for j, c in enumerate(calls)]
            _, reason = self.message(parser.text, u.finish_reason)
            out.append({"index": i, "delta": delta, "logprobs": None, "finish_reason": reason})
        return out
