# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py//py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 07: Generating text with the demo model, and what 4-bit weights cost it
#
# Notebook 06 checked the decoder against HF on random weights. Random weights say nothing about text, so the
# workbench ships a model that has learnt some: `data/models/lynn-demo`, a tiny Qwen3.5-MoE (11.6M parameters)
# trained for six minutes on an H200 on public-domain English (Jane Austen, the World English Bible, Moby Dick,
# the State of the Union addresses), with a multi-token prediction head (1.4M parameters more) trained afterwards
# for speculative decoding. It is what `lynn generate` runs when no `--model` is given. This notebook:
#
# 1. loads it with `lynn_model` and its tokenizer: the configuration and where the parameters are
# 2. tokenization: text to ids and back
# 3. generation: greedy and sampled, and what temperature, top-k, top-p and the seed do to the next-token
#    distribution
# 4. the token stream with the probability of every token and its top-5 alternatives, coloured, and an explorer
# 5. speculative decoding: the model's MTP head drafts tokens, the trunk verifies them; which drafts it keeps,
#    token by token, under greedy and sampled decoding, and what it costs on a CPU
# 6. perplexity: computed live on a small held-out slice, then the committed table for bf16, NVFP4 and int4, and
#    bf16 against NVFP4 on one prompt, live
# 7. the training run: loss curves and provenance
# 8. `lynn generate` on the H200, from committed output
# 9. `lynn serve`: the model behind an OpenAI-compatible HTTP server, started here and talked to with the `openai`
#    client
#
# Everything runs on the torch reference path (`lynn_kernels.use_reference()`), in well under a minute on a CPU. On
# a GPU it computes in bf16, as the model is shipped; on a CPU in float32, because CPUs round bf16 matmuls
# differently (those with native bf16 dot products and those without), and the sampled text below would change from
# one CPU to the next. The slow measurements (perplexity over the whole held-out set, training) are
# read from committed files. The model, corpus and measurements are described in `docs/quantization.md`.

# %%
# %matplotlib inline
import html
import json
import math
import textwrap
from collections import Counter
from functools import lru_cache

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import HTML, display

import lynn_kernels as lk  # first of ours: it picks the backend before any kernel is defined
import lynn_model
from lynn_cli.generate import DEMO_MODEL, DEMO_PROMPT
from lynn_kernels import render_table
from lynn_model import checkpoint

plt.rcParams.update({"figure.dpi": 90, "font.size": 8})
ROOT = DEMO_MODEL.parents[2]             # the repository
HELDOUT = ROOT / "data" / "corpus" / "heldout.txt"
TRAINING = DEMO_MODEL / "training"


def read_json(path):
    return json.loads(path.read_text())


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wrap(text, width=110, indent="    "):
    return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent)


# %%
# NBVAL_IGNORE_OUTPUT
print(lk.device_summary())

# %% [markdown]
# ## 1. The demo model
#
# `lynn_model.from_pretrained(folder)` reads `config.json` into a `Config` and the safetensors shards into a
# `Model`; `lynn_model.Tokenizer.from_pretrained(folder)` reads `tokenizer.json` and the chat template. The
# weights stay as stored (bf16) unless `weights="nvfp4"` asks for them to be quantised on load (section 6);
# `dtype` is what the activations are computed in (bf16 by default; float32 here on a CPU).

# %%
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32   # float32: the same digits on every CPU
with lk.use_reference():
    model = lynn_model.from_pretrained(DEMO_MODEL, dtype=DTYPE)
tok = lynn_model.Tokenizer.from_pretrained(DEMO_MODEL)
cfg = model.config

pattern = " ".join("A" if t == "full_attention" else "L" for t in cfg.layer_types)
print(f"{cfg.name}: family {cfg.family}, {model.dtype} on {model.device}")
print(f"layers      {cfg.num_hidden_layers}: {pattern}   (L = Gated DeltaNet, A = gated attention)")
print(f"hidden      {cfg.hidden_size}, vocabulary {cfg.vocab_size:,}, tied embedding / LM head: "
      f"{cfg.tie_word_embeddings}")
print(f"DeltaNet    {cfg.linear_num_key_heads} key heads, {cfg.linear_num_value_heads} value heads of "
      f"{cfg.linear_key_head_dim}, conv {cfg.linear_conv_kernel_dim}")
print(f"attention   {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads of {cfg.head_dim}, "
      f"RoPE over {cfg.rotary_dim} dims (theta {cfg.rope_theta:g})")
print(f"MoE         every layer: {cfg.num_experts} routed experts, top-{cfg.num_experts_per_tok}, intermediate "
      f"{cfg.moe_intermediate_size}; a shared expert of {cfg.shared_expert_intermediate_size}")
print(f"generation  {read_json(DEMO_MODEL / 'generation_config.json')}")

# %% [markdown]
# Where the parameters are, counted from the checkpoint's safetensors headers (`checkpoint.read_headers`, no data
# read). A token runs through 2 of the 8 routed experts of each layer, so only part of the model is active per
# token; the MTP module only drafts tokens for speculative decoding (section 5) and takes no part in a plain step:

# %%
def group(name):
    if name.startswith("mtp."):
        return "MTP module (section 5)"
    if "embed_tokens" in name:
        return "embedding (= LM head, tied)"
    if ".mlp.experts." in name:
        return "routed experts"
    if ".shared_expert" in name:
        return "shared experts and their gates"
    if ".mlp.gate." in name:
        return "routers"
    if ".linear_attn." in name:
        return "Gated DeltaNet mixers"
    if ".self_attn." in name:
        return "attention mixers"
    return "norms"


counts = Counter()
for e in checkpoint.read_headers(DEMO_MODEL):
    counts[group(e.name)] += math.prod(e.shape)
total = sum(counts.values())
head = counts["MTP module (section 5)"]
trunk = total - head
active = trunk - counts["routed experts"] * (1 - cfg.num_experts_per_tok / cfg.num_experts)
print(render_table([{"part": k, "parameters": f"{v:,}", "share": f"{v / total:.1%}"}
                    for k, v in counts.most_common()]))
print(f"\nthe trunk: {trunk:,} parameters ({trunk * 2 / 1e6:.1f} MB in bf16), active per token about "
      f"{active / 1e6:.2f}M; the MTP module: {head:,} more")

# %% [markdown]
# ## 2. Tokenization
#
# The model reads and writes **token ids**, not characters. The tokenizer is a byte-level BPE of 6,144 tokens
# trained on the same corpus: text is first split by Qwen's regex (words with their leading space, single
# digits, punctuation runs), then each piece is merged into the longest known tokens. Frequent words are one
# token, rare ones several. In the vocabulary a leading space shows as `Ġ`; decoding gives it back.

# %%
sentence = "Call me Ishmael. It is a truth universally acknowledged, that a single man in possession of a fortune"
ids = tok.encode(sentence)
print(f"{len(sentence)} characters -> {len(ids)} tokens")
print(render_table([{"position": i, "id": t, "vocabulary entry": tok.tok.id_to_token(t),
                     "decodes to": repr(tok.decode([t]))} for i, t in enumerate(ids)]))
print("decode(encode(text)) == text:", tok.decode(ids) == sentence)

# %% [markdown]
# Three ids are special: `<|endoftext|>` (0) ends a document (the model may emit it to stop), `<|im_start|>` and
# `<|im_end|>` frame a chat turn in the ChatML template the checkpoint carries (`lynn generate --chat`; the model
# was never trained on chats, so it has no idea what to do with one). Over the held-out text, English prose takes
# about four characters per token:

# %%
heldout_text = HELDOUT.read_text()
heldout_ids = tok.encode(heldout_text)
print(f"special tokens: {[(t, tok.token_id(t)) for t in ('<|endoftext|>', '<|im_start|>', '<|im_end|>')]}")
print("chat template:", repr(tok.apply_chat_template([{"role": "user", "content": "Hello"}])))
print(f"held-out text: {len(heldout_text):,} characters, {len(heldout_ids):,} tokens, "
      f"{len(heldout_text) / len(heldout_ids):.2f} characters per token")

# %% [markdown]
# ## 3. Generation: greedy and sampled
#
# A decoder gives, after every prefix, **logits**: one score per vocabulary entry, whose softmax is the model's
# distribution over the next token. Generating is a loop: pick a token from that distribution, append it, run
# one more step. `lynn_model.generate(model, ids, n, temperature=..., top_k=..., top_p=..., seed=...)` does it
# with a cache (one prefill of the prompt, then one decode step per token; notebook 06). How the token is picked
# is up to the caller:
#
# * **greedy** (`temperature=0`): always the most likely token. Deterministic, and with a small model it soon
#   loops on a phrase.
# * **temperature** `T`: sample from `softmax(logits / T)`. `T < 1` sharpens the distribution towards the top
#   tokens, `T > 1` flattens it towards the tail (each probability becomes proportional to `p^(1/T)`).
# * **top-k**: keep only the `k` most likely tokens before drawing.
# * **top-p** (nucleus): keep the smallest set of most likely tokens whose probabilities reach `p` (the best
#   token always stays).
# * **seed**: each draw is a hash of the seed, the new token's position and the token id (the Gumbel-max trick,
#   `lynn_model.sampling`), so the same seed, settings and machine give the same text, captured as a CUDA graph or
#   not.
#
# `lynn_model.sample` applies them in that order: temperature, then top-k, then top-p. The checkpoint's
# `generation_config.json` (what `lynn generate` uses by default) says `T = 0.8`, top-k 40, top-p 0.95. The same
# prompt with different settings, 24 new tokens each:

# %%
prompt_ids = tok.encode(DEMO_PROMPT)
PROMPT = torch.tensor([prompt_ids])
NEW = 24
SETTINGS = [
    ("greedy", {"temperature": 0.0}),
    ("T 0.8, top-k 40, top-p 0.95, seed 0 (lynn generate's default)", {"temperature": 0.8, "top_k": 40,
                                                                        "top_p": 0.95, "seed": 0}),
    ("T 0.8, top-k 40, top-p 0.95, seed 1", {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1}),
    ("T 0.5, seed 0", {"temperature": 0.5, "seed": 0}),
    ("T 1.0, seed 0 (the model's own distribution)", {"temperature": 1.0, "seed": 0}),
    ("T 1.5, seed 0", {"temperature": 1.5, "seed": 0}),
    ("T 1.5, top-k 10, seed 0", {"temperature": 1.5, "top_k": 10, "seed": 0}),
    ("T 1.0, top-p 0.5, seed 0", {"temperature": 1.0, "top_p": 0.5, "seed": 0}),
]
print(f"prompt ({len(prompt_ids)} tokens): {DEMO_PROMPT!r}\n")
outs = {}
with lk.use_reference():
    for label, kw in SETTINGS:
        outs[label] = lynn_model.generate(model, PROMPT, NEW, **kw)
        print(f"{label}:\n{wrap('...' + tok.decode(outs[label][0, len(prompt_ids):].tolist()))}")
    label, kw = SETTINGS[1]
    again = lynn_model.generate(model, PROMPT, NEW, **kw)
print(f"\n{label}, run again: the same tokens: {torch.equal(again, outs[label])}")

# %% [markdown]
# Greedy repeats itself ("had been there, and ... had been there"): the most likely token after a phrase is
# often the one that starts it again. A low temperature is nearly greedy; `T = 1` draws from the model as it is;
# `T = 1.5` reaches deep into the tail and the text falls apart; top-k and top-p cut that tail off again.
#
# What the knobs do is clearest on one distribution: the next token after the prompt ("...and the captain").
# Left, the 12 most likely tokens at three temperatures; right, the probability mass of the best `r` tokens
# against `r`: top-p 0.95 keeps the tokens left of where a curve crosses 0.95, top-k 40 those left of the
# dotted line.

# %%
with lk.use_reference(), torch.no_grad():
    next_logits = model.forward(PROMPT)[0, -1].float()            # [vocab]: the scores for the next token

TEMPS, TOP_K, TOP_P = (0.5, 1.0, 1.5), 40, 0.95


def kept_by(probs, top_k=None, top_p=None):
    """How many of the best tokens `sample` keeps (probs sorted best first)."""
    n = probs.numel() if top_k is None else min(top_k, probs.numel())
    if top_p is not None and top_p < 1:
        before = probs.cumsum(0) - probs                         # mass of the better tokens
        n = min(n, int((before < top_p).sum()))
    return n


order = next_logits.argsort(descending=True)
rows = []
for t in TEMPS:
    p = (next_logits / t).softmax(-1)[order]
    entropy = float(-(p * p.clamp_min(1e-30).log()).sum())
    rows.append({"temperature": t, "p(best)": f"{p[0]:.3f}", "entropy (nats)": f"{entropy:.2f}",
                 "as many choices as": f"{math.exp(entropy):.0f}", f"top-k {TOP_K} keeps": kept_by(p, TOP_K),
                 f"top-p {TOP_P} keeps": kept_by(p, top_p=TOP_P), "both keep": kept_by(p, TOP_K, TOP_P)})
print(render_table(rows))

# the same count from lynn_model.sample itself: 4,000 draws with both cut-offs never leave the kept set
draws = lynn_model.sample(next_logits.expand(4000, -1), temperature=1.0, top_k=TOP_K, top_p=TOP_P, seed=0,
                          counter=torch.arange(4000))                 # 4,000 positions: independent draws
allowed = set(order[:rows[1]["both keep"]].tolist())
print(f"\nsample(T=1, top_k={TOP_K}, top_p={TOP_P}), 4,000 draws: {len(set(draws.tolist()))} distinct tokens, "
      f"all among the {len(allowed)} kept: {set(draws.tolist()) <= allowed}")

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))
show = order[:12]
width = 0.27
colours = {0.5: "tab:blue", 1.0: "0.35", 1.5: "tab:orange"}
for j, t in enumerate(TEMPS):
    p = (next_logits / t).softmax(-1)
    ax1.bar([i + (j - 1) * width for i in range(len(show))], p[show], width, color=colours[t], label=f"T = {t}")
    srt = p[order]
    cum = srt.cumsum(0)
    ax2.plot(range(1, len(cum) + 1), cum, color=colours[t], label=f"T = {t}")
    cut = kept_by(srt, top_p=TOP_P)
    ax2.plot([cut], [cum[cut - 1]], "o", color=colours[t], ms=4)
ax1.set_xticks(range(len(show)), [repr(tok.decode([i])) for i in show.tolist()], rotation=60, fontsize=7)
ax1.set_ylabel("probability")
ax1.set_title("next token after '...and the captain'", fontsize=8)
ax1.legend(fontsize=7)
ax2.axhline(TOP_P, color="k", lw=0.6)
ax2.axvline(TOP_K, color="k", lw=0.8, ls=":")
ax2.text(TOP_K * 1.1, 0.05, f"top-k {TOP_K}", fontsize=7)
ax2.text(1.1, TOP_P + 0.01, f"top-p {TOP_P}", fontsize=7)
ax2.set_xscale("log")
ax2.set_xlabel("rank r")
ax2.set_ylabel("mass of the best r tokens")
ax2.set_title("where top-p (dots) and top-k cut", fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# At `T = 0.5` the mass sits in a handful of tokens and top-p 0.95 alone keeps only those; at `T = 1` it keeps
# hundreds, at `T = 1.5` thousands, and top-k 40 does the cutting. That is why the defaults combine a moderate
# temperature with both cut-offs.
#
# ## 4. The token stream, with probabilities
#
# To see what the model thought at every step, the cell below runs the same loop as `generate` (a cache from
# `model.new_cache`, a prefill with `model.step`, then one `model.step` per token, `lynn_model.sample` with the
# seed and the new token's position) and keeps the model's distribution at each step: the probability of the token drawn and the
# five most likely tokens. The probabilities are the model's own (softmax of the logits, `T = 1`), before the
# sampling settings reshape them. With the same seed and settings the tokens are exactly `generate`'s:

# %%
def token_stream(prompt, n, temperature=0.8, top_k=40, top_p=0.95, seed=0, logits_out=None):
    """n tokens after `prompt` (a list of ids) as lynn_model.generate draws them, with the model's distribution
    at each step: a list of (token, p(token), [(alternative, p), ...top 5]); `logits_out`, a list, gets each
    step's logits."""
    cache = model.new_cache(max_batch=1, max_tokens=len(prompt) + n + 16)
    slot = cache.add()
    step_in, steps = torch.tensor(prompt), []
    with lk.use_reference(), torch.inference_mode():
        for i in range(n):
            logits = model.step(step_in, cache, [slot], [step_in.numel()])        # [1, vocab]: the last position
            nxt = lynn_model.sample(logits, temperature=temperature, top_k=top_k or None, top_p=top_p, seed=seed,
                                    counter=len(prompt) + i)               # the index the new token takes
            probs = logits[0].float().softmax(-1)
            top = probs.topk(5)
            if logits_out is not None:
                logits_out.append(logits[0].float())
            steps.append((int(nxt), float(probs[nxt]), list(zip(top.indices.tolist(), top.values.tolist()))))
            step_in = nxt
    return steps


STREAM = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 0}
N_STREAM = 40
stream = token_stream(prompt_ids, N_STREAM, **STREAM)
with lk.use_reference():
    ref = lynn_model.generate(model, PROMPT, N_STREAM, **STREAM)[0, len(prompt_ids):].tolist()
print(f"{N_STREAM} tokens, {STREAM}: the same as generate's: {[t for t, _, _ in stream] == ref}")
print(render_table([{"position": i, "token": repr(tok.decode([t])), "p": f"{p:.3f}",
                     "rank": 1 + [a for a, _ in top].index(t) if t in [a for a, _ in top] else "> 5",
                     "top 5 (p)": ", ".join(f"{tok.decode([a])!r} {q:.2f}" for a, q in top)}
                    for i, (t, p, top) in enumerate(stream[:12])]))

# %% [markdown]
# The whole stream, coloured by the probability the model gave each token (hover over a token for its top-5
# alternatives). Green tokens were near-certain (the second half of a word, "the" after "of"), red ones were
# a gamble the sampler took:

# %%
def colour(p):
    """Probability -> a background colour: red (p <= 0.01) through yellow to green (p = 1), on a log scale."""
    x = min(max((math.log10(max(p, 1e-12)) + 2) / 2, 0.0), 1.0)
    r, g, b, _ = plt.cm.RdYlGn(0.1 + 0.8 * x)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def piece(t):
    return html.escape(tok.decode([t])).replace("\n", "&#8629;<br>")


def render_stream(prompt, steps, mark=None):
    """HTML: the prompt in grey, then each token on its probability's colour; `mark` outlines one position."""
    spans = [f'<span style="color:#777">{html.escape(tok.decode(prompt))}</span>']
    for i, (t, p, top) in enumerate(steps):
        tip = f"position {i}: p = {p:.3f}; top 5: " + ", ".join(f"{tok.decode([a])!r} {q:.3f}" for a, q in top)
        border = "outline:2px solid #000;" if i == mark else ""
        spans.append(f'<span title="{html.escape(tip)}" style="background:{colour(p)};{border}">{piece(t)}</span>')
    key = " ".join(f'<span style="background:{colour(p)};padding:0 4px">{p:g}</span>' for p in (0.01, 0.1, 0.5, 1))
    return (f'<div style="font-family:monospace;line-height:1.7;max-width:60em">{"".join(spans)}</div>'
            f'<div style="font-size:80%;margin-top:4px">p(token): {key}</div>')


display(HTML(render_stream(prompt_ids, stream)))

# %% [markdown]
# The mean of `-log p` over the stream is the model's cross-entropy on its own sample: low, since `T = 0.8` and the
# cut-offs favour likely tokens. Section 6 computes the same quantity on text the model has never seen:

# %%
logp = [math.log(p) for _, p, _ in stream]
top1 = sum(t == top[0][0] for t, _, top in stream)
print(f"{N_STREAM} sampled tokens: mean -log p = {-sum(logp) / len(logp):.2f} nats "
      f"(perplexity {math.exp(-sum(logp) / len(logp)):.1f}); the model's top choice {top1} times, "
      f"p < 0.05 {sum(p < 0.05 for _, p, _ in stream)} times")

# %% [markdown]
# **Explorer.** The slider moves over the positions of the stream: the selected token is outlined, and the bars
# show the ten most likely tokens there, as the model gives them (grey) and after the temperature / top-k / top-p
# below (blue), the token drawn in red. Changing the settings or the seed regenerates the stream (a second or
# two on the reference path). Its output depends on the widgets, so nbval does not check it; the coloured text
# above is the static rendering of the default settings.

# %%
# NBVAL_IGNORE_OUTPUT
import ipywidgets as widgets


@lru_cache(maxsize=32)
def cached_stream(temperature, top_k, top_p, seed):
    logits = []
    return token_stream(prompt_ids, N_STREAM, temperature, top_k, top_p, seed, logits_out=logits), logits


def explore(position, temperature, top_k, top_p, seed):
    steps, all_logits = cached_stream(temperature, top_k, top_p, seed)
    display(HTML(render_stream(prompt_ids, steps, mark=position)))
    logits = all_logits[position]
    raw = logits.softmax(-1)
    srt, idx = (logits / max(temperature, 1e-6)).softmax(-1).sort(descending=True)
    n = 1 if temperature == 0 else kept_by(srt, top_k or None, top_p)
    filt = torch.zeros_like(raw)
    filt[idx[:n]] = srt[:n] / srt[:n].sum()
    best = raw.argsort(descending=True)[:10]
    chosen = steps[position][0]
    _, ax = plt.subplots(figsize=(6, 2.4))
    xs = range(len(best))
    ax.bar([x - 0.2 for x in xs], raw[best], 0.4, color="0.6", label="model, T = 1")
    ax.bar([x + 0.2 for x in xs], filt[best], 0.4, color="tab:blue", label="after T / top-k / top-p")
    ax.set_xticks(list(xs), [repr(tok.decode([i])) for i in best.tolist()], rotation=45, fontsize=7)
    for lab, i in zip(ax.get_xticklabels(), best.tolist()):
        lab.set_color("red" if i == chosen else "black")
    ax.set_title(f"position {position}: drew {tok.decode([chosen])!r} (p = {raw[chosen]:.3f}); "
                 f"{n} candidates kept", fontsize=8)
    ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()


style = {"description_width": "initial"}
controls = {
    "position": widgets.IntSlider(0, min=0, max=N_STREAM - 1, description="position", style=style),
    "temperature": widgets.FloatSlider(0.8, min=0.0, max=2.0, step=0.1, description="temperature", style=style),
    "top_k": widgets.IntSlider(40, min=0, max=200, description="top_k (0: off)", style=style),
    "top_p": widgets.FloatSlider(0.95, min=0.05, max=1.0, step=0.05, description="top_p", style=style),
    "seed": widgets.IntSlider(0, min=0, max=50, description="seed", style=style),
}
c_ = list(controls.values())
display(widgets.VBox([c_[0], widgets.HBox(c_[1:3]), widgets.HBox(c_[3:]),
                      widgets.interactive_output(explore, controls)]))

# %% [markdown]
# Things to try: temperature 0 (greedy: one candidate at every position); a high temperature with top-k off, then
# the same with top-k 10; the same settings with another seed. Positions where the grey bars are nearly level are
# where two runs, or two versions of the weights, are most likely to part (section 6).
#
# ## 5. Speculative decoding with the MTP head
#
# Qwen3.5 checkpoints carry a **multi-token prediction (MTP) module**: one extra decoder layer that reads the
# trunk's last hidden state and the token just chosen and guesses the token after that; fed its own output, it
# guesses on. `generate(..., mtp=k)` lets it **draft** `k` tokens, then runs the trunk once over the known token and
# the `k` drafts (one **verify** step of `k + 1` tokens, each computed as its own decode step would compute it),
# keeps the drafts up to the first one the trunk rejects and appends the trunk's own token after them: one
# to `k + 1` tokens per step of the trunk, and greedy output is plain greedy's, token for token. The round in full,
# and why it is exact, is in [docs/decoder.md](../docs/decoder.md), section 5 ("Speculative decoding").
#
# The demo model's head (`mtp.safetensors`) was trained after the trunk, the trunk frozen, by
# `experiments/demo_model/train_mtp.py`. Its record, where *agreement* is how often, on held-out text, the head's
# best guess for the token after next is the trunk's own greedy token (a forecast of how often a greedy first draft
# is kept), and the check that the decoder's `Model.mtp_step` computes the head the training script trained:

# %%
# NBVAL_IGNORE_OUTPUT
MTP_DIR = TRAINING / "mtp"
rec = read_json(MTP_DIR / "train_mtp_record.json")
print(render_table([
    {"": "date, device", "head": f"{rec['date'][:16].replace('T', ' ')}, {rec['gpu']}"},
    {"": "commit, torch", "head": f"{rec['git_sha'][:7]}{' (dirty)' if rec['git_dirty'] else ''}, {rec['torch']}"},
    {"": "parameters", "head": f"{rec['head_parameters']:,} (warm start: {rec['warm_start']})"},
    {"": "steps", "head": f"{rec['steps']:,} of {rec['batch']} x {rec['seq']} tokens ({rec['epochs']:.2f} epochs), "
                          f"{rec['train_seconds']:.0f} s"},
    {"": "agreement with the trunk", "head": f"{rec['initial']['agreement']:.3f} at the start, "
                                             f"{rec['best']['agreement']:.3f} kept (step {rec['best']['step']:,})"},
]))
verify = read_json(MTP_DIR / "verify.json")
fc = verify["forward_check"]
print(f"\nHF head (training) vs Model.mtp_step, fp32, {fc['positions']} positions: logits "
      f"{fc['max_abs_logit_diff']:.1e} apart at most (of {fc['max_abs_logit']:.1f}), the same top-1 at "
      f"{fc['top1_same']:.0%}")
print("\n" + rec["command"])

# %% [markdown]
# Greedy, 48 tokens after the notebook's prompt, plainly and with three drafts per step:

# %%
SPEC_NEW, K = 48, 3
plain_stats, spec_stats = lynn_model.Stats(), lynn_model.Stats()
with lk.use_reference():
    plain = lynn_model.generate(model, PROMPT, SPEC_NEW, stats=plain_stats)
    spec = lynn_model.generate(model, PROMPT, SPEC_NEW, mtp=K, stats=spec_stats)
assert torch.equal(spec, plain), f"greedy with mtp={K} must give plain greedy's tokens"
print(f"mtp={K}: the same {SPEC_NEW} tokens as plain greedy")
print(render_table([
    {"": "plain", "steps of the trunk after the prefill": plain_stats.decode_steps, "drafts": "-", "kept": "-",
     "tokens per step": "1"},
    {"": f"mtp={K}", "steps of the trunk after the prefill": spec_stats.verify_steps, "drafts": spec_stats.drafted,
     "kept": f"{spec_stats.accepted} ({spec_stats.accepted / spec_stats.drafted:.0%})",
     "tokens per step": f"{spec_stats.acceptance_length:.2f}"}]))

# %% [markdown]
# Tokens per step is the **acceptance length**: the drafts kept per round plus the trunk's own token
# (`Stats.acceptance_length`).
#
# **On a GPU the verify's rows must be summed as the decode step sums them.** The compiled kernels choose their tiles
# by how many rows they get (one or two rows take the packed GEMV, more the tensor-core GEMV; the MoE decode tiles,
# the attention's KV splits and cuBLAS's kernel for the bf16 LM head change too), and another tile sums a row in
# another order, so its logits can differ in the last bits and a near-tie goes the other way. The verify therefore
# runs inside `lynn_kernels.as_batch(n)`: every op picks what a call of `n` rows (the decode step's) picks and runs
# the `n (k + 1)` rows in pieces that each sum a row that way. On this CPU every row is summed alike anyway; the
# committed GPU check, at Qwen3.5-35B-A3B's widths (four layers, random weights) and on the demo model:

# %%
unroll = read_json(ROOT / "data/experiments/unroll-bits/bfb0a2b-h100.json")
print(render_table([{"batch": c["batch"], "tokens a sequence (k + 1)": c["tokens"],
                     "unrolled logits = the decode steps'": c["logits_equal"]} for c in unroll["cases"]]))
gpu = read_json(MTP_DIR / "verify-h100.json")
print(f"\ndemo model on {gpu['gpu']}, greedy, {gpu['prompts']} prompts: " + "; ".join(
    f"mtp={k}: {'the same' if gpu['runs'][f'mtp={k}']['same_as_mtp0'] else 'NOT the same'} "
    f"{gpu['runs'][f'mtp={k}']['new_tokens']} tokens as plain" for k in (1, 2, 3)))
#
# **Drafts accepted and rejected, token by token.** `stats.rounds` holds each round as `(sequence, drafts, how
# many were kept, the trunk's token after them)`, and a round emits `drafts[:kept] + [token]`. Below, each round
# starts at a thin bar: the drafts the trunk kept on green, the first draft it rejected struck through on red, then
# the trunk's own token on blue, the one that replaces the rejected draft, or, in bold, the bonus token after all
# three drafts were kept. The first new token comes from the prefill, before any round. Hover over a round for
# all its drafts:

# %%
KEPT, REJECTED, TRUNK = "#b5e3ad", "#f4a6a6", "#c4d8f2"


def render_rounds(prompt, first, rounds, n):
    """HTML: the prompt in grey, the prefill's token, then the rounds of `Stats.rounds` up to `n` new tokens in
    all: each round's kept drafts, its first rejected draft and the trunk's token after them."""
    spans = [f'<span style="color:#777">{html.escape(tok.decode(prompt))}</span>{piece(first)}']
    left = n - 1
    for i, (_, drafts, kept, y) in enumerate(rounds):
        emitted = (drafts[:kept] + [y])[:left]             # the last round stops at n tokens
        parts = [f'<span style="background:{KEPT}">{piece(d)}</span>' for d in emitted[:kept]]
        if len(emitted) == kept + 1:
            if kept < len(drafts):
                parts.append(f'<span style="background:{REJECTED};text-decoration:line-through">'
                             f'{piece(drafts[kept])}</span>')
            bold = "font-weight:bold;" if kept == len(drafts) else ""
            parts.append(f'<span style="background:{TRUNK};{bold}">{piece(y)}</span>')
        tip = (f"round {i}: drafts " + ", ".join(repr(tok.decode([d])) for d in drafts)
               + f"; {kept} kept; the trunk's token {tok.decode([y])!r}")
        spans.append(f'<span title="{html.escape(tip)}" style="border-left:1px solid #666">{"".join(parts)}</span>')
        left -= len(emitted)
    key = " ".join(f'<span style="background:{c};{s}padding:0 4px">{w}</span>' for c, s, w in (
        (KEPT, "", "draft kept"), (REJECTED, "text-decoration:line-through;", "draft rejected"),
        (TRUNK, "", "the trunk's token"), (TRUNK, "font-weight:bold;", "bonus token")))
    return (f'<div style="font-family:monospace;line-height:1.7;max-width:60em">{"".join(spans)}</div>'
            f'<div style="font-size:80%;margin-top:4px">{key}</div>')


new = spec[0, len(prompt_ids):].tolist()
emitted = [new[0]] + [t for _, drafts, kept, y in spec_stats.rounds for t in drafts[:kept] + [y]]
assert emitted[:SPEC_NEW] == new, "the rounds emit generate's tokens"
display(HTML(render_rounds(prompt_ids, new[0], spec_stats.rounds, SPEC_NEW)))

kept = [a for _, _, a, _ in spec_stats.rounds]
reached = [sum(a >= j for a in kept) for j in range(K + 1)]       # rounds whose first j drafts were all kept
print(f"{len(kept)} rounds; keeping 0, 1, 2, 3 drafts: {', '.join(str(kept.count(j)) for j in range(K + 1))}")
print("draft j kept, of the rounds that kept the drafts before it: " + ", ".join(
    f"j = {j + 1}: {reached[j + 1]}/{reached[j]}" for j in range(K)))

# %% [markdown]
# The drafts that pass are the glue of the text and the ends of words (", and", " had been", "night" after the
# trunk's " fort"); the head and the trunk part at content words (" sitting" where the trunk says " there",
# " course" where it says " way"). The same rounds as a picture: the drafts each round kept, and for each draft
# position the share kept of the rounds that reached it.

# %%
# NBVAL_IGNORE_OUTPUT
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 2.4), gridspec_kw={"width_ratios": [3, 1]})
ax1.bar(range(len(kept)), kept, color=["tab:green" if a == K else "tab:olive" for a in kept])
ax1.axhline(spec_stats.acceptance_length - 1, color="k", lw=0.8, ls="--")
ax1.set_yticks(range(K + 1))
ax1.set_xlabel("round")
ax1.set_ylabel("drafts kept")
ax1.set_title(f"greedy, mtp={K}: drafts kept per round (dashed: the mean)", fontsize=8)
ax2.bar(range(1, K + 1), [reached[j + 1] / max(1, reached[j]) for j in range(K)], color="tab:green")
ax2.set_xticks(range(1, K + 1))
ax2.set_ylim(0, 1)
ax2.set_xlabel("draft position j")
ax2.set_title("kept, given j - 1 kept", fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# **Sampling: two acceptance rules.** With a temperature the trunk's token is a draw, and a draft can pass in two
# ways (`mtp_rule`). *Coupled* (the default) keeps a draft when it is the very token plain sampling draws there:
# the head draws its drafts with the same seeded Gumbel noise as the trunk (section 3), so the text is plain seeded
# sampling's, token for token. *Rejection* is the speculative sampling test (Leviathan et al., Chen et al., 2023): a
# draft `d` drawn from the head's distribution `q` is kept with probability `min(1, p(d) / q(d))`, `p` the
# trunk's, and the first one rejected is redrawn from `max(0, p - q)`, normalised; each token is distributed as plain
# sampling's, but the text is not a plain run's with the same seed. With the settings and seed of section 3
# (`T = 0.8`, top-k 40, top-p 0.95, seed 0):

# %%
label, kw = SETTINGS[1]
sampled = {}
with lk.use_reference():
    for rule in ("coupled", "rejection"):
        st = lynn_model.Stats()
        out = lynn_model.generate(model, PROMPT, NEW, **kw, mtp=K, mtp_rule=rule, stats=st)
        sampled[rule] = (out, st)
        print(f"{rule:9}: {st.accepted}/{st.drafted} drafts kept, the same {NEW} tokens as plain sampling in "
              f"section 3: {torch.equal(out, outs[label])}")
        print(wrap("..." + tok.decode(out[0, len(prompt_ids):].tolist())))

# %% [markdown]
# 24 tokens are a small sample. The committed check counts more: six held-out prompts of 64 tokens,
# 64 new tokens each, at `T = 0.8` (no top-k or top-p), seeded, under both rules and `k = 1, 2, 3`
# (`data/models/lynn-demo/training/mtp/verify.json`, written by `train_mtp.py` after training):

# %%
# NBVAL_IGNORE_OUTPUT
samp = verify["sampled"]
print(f"T = {samp['temperature']}, {verify['prompts']} prompts of {verify['prompt_tokens']} tokens, "
      f"{verify['new_tokens']} new tokens each, seed = the prompt's number")
print(render_table([{"rule": rule, "k": k, "drafts kept": f"{v['accepted']}/{v['drafted']} "
                     f"({v['draft_acceptance']:.0%})", "tokens per step": f"{v['acceptance_length']:.2f}",
                     "the same tokens as plain sampling": {True: "yes", False: "no"}.get(
                         v.get("same_as_plain_sampling"), "-")}
                    for rule in ("coupled", "rejection") for k in (1, 2, 3)
                    for v in [samp[f"{rule} mtp={k}"]]]))
fig, ax = plt.subplots(figsize=(5, 2.4))
for j, (rule, c) in enumerate((("coupled", "tab:blue"), ("rejection", "tab:orange"))):
    ax.bar([k + (j - 0.5) * 0.35 for k in (1, 2, 3)], [samp[f"{rule} mtp={k}"]["acceptance_length"]
                                                      for k in (1, 2, 3)], 0.35, color=c, label=rule)
ax.set_xticks([1, 2, 3])
ax.set_xlabel("drafts per step k")
ax.set_ylim(1, None)
ax.set_ylabel("tokens per step")
ax.set_title(f"sampled at T = {samp['temperature']}: tokens per step by rule", fontsize=8)
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# Rejection keeps more: a draft passes with probability `sum min(p, q)` over the vocabulary, the overlap of the two
# distributions and the most any rule can keep, where the coupled rule needs the head's draw and the trunk's, made
# with the same noise from different distributions, to land on the same token. What the coupled rule buys with its
# lower rate is the text itself: a seeded request writes plain sampling's tokens at any `k`, wherever a row's
# logits come out the same bits whatever the rows beside it (docs/decoder.md). The torch reference path does not
# quite give that: in the committed check one of the 18 seeded runs (`k = 3`) parted from plain sampling, at a
# token where the verify row's logits and the decode step's differ by a rounding and the draw fell on the other
# side. The greedy runs kept plain decoding's tokens at every `k` (below).
#
# **What it costs here.** The same check timed `generate`, greedy, with `mtp = 0..3` on the torch reference path
# of a 2-core CPU, one thread. A round there (`k` drafts of the head, a verify of `k + 1` tokens, the head's
# catch-up) costs 1.6, 2.1 and 2.7 plain steps at `k = 1, 2, 3`, more than the 1.49, 1.72 and 1.85 tokens it
# yields, so MTP is slower on this path:

# %%
# NBVAL_IGNORE_OUTPUT
runs_v = verify["runs"]
plain_step = runs_v["mtp=0"]["cpu_seconds"] / runs_v["mtp=0"]["new_tokens"]    # each plain token is one step
print(f"{verify['prompts']} prompts x {verify['new_tokens']} tokens, greedy, torch reference, "
      f"{verify['torch_threads']} thread, the least of {verify['reps']} runs; load average "
      f"{verify['load_average_before']:.1f} before, {verify['load_average_after']:.1f} after; "
      f"{verify['date'][:16].replace('T', ' ')}, git {verify['git_sha'][:7]}"
      f"{' (dirty)' if verify['git_dirty'] else ''}, torch {verify['torch']}")
rows = []
for k in range(4):
    v = runs_v[f"mtp={k}"]
    # + each prompt's prefill, which gives its first token
    steps = v.get("verify_steps", v["new_tokens"] - verify["prompts"]) + verify["prompts"]
    rows.append({"mtp": k, "tok/s": f"{v['tok_s']:.1f}", "tokens per CPU s": f"{v['tok_per_cpu_s']:.1f}",
                 "vs mtp=0": f"{v['tok_per_cpu_s'] / runs_v['mtp=0']['tok_per_cpu_s']:.2f}x",
                 "tokens per step": f"{v.get('acceptance_length', 1.0):.2f}",
                 "a round costs (plain steps)": f"{v['cpu_seconds'] / steps / plain_step:.2f}",
                 "the same tokens as mtp=0": {True: "yes", False: "no"}.get(v.get("same_as_mtp0"), "-")})
print(render_table(rows))

# %% [markdown]
# MTP pays where a verify of `k + 1` tokens costs little more than a step of one: on a GPU, where a decode step of
# a large model is bound by reading its weights, once per step whatever the number of tokens. The H200 figures
# (the demo model with its head, and `experiments/mtp_verify.py` at the Qwen3.5-35B-A3B shape) are not measured
# yet.
#
# ## 6. Perplexity, and what 4-bit weights cost
#
# The standard measure of a language model is its **cross-entropy** on held-out text: the mean, over every
# position, of `-log p(the actual next token | the text before it)`, in nats. Its exponential is the
# **perplexity**: a model of perplexity 40 is, on average, as unsure as a uniform choice among 40 tokens (a
# model that knew nothing would score 6,144, the vocabulary size). One forward over a window gives the
# distribution at every position at once, so a window of `n` tokens scores `n - 1` predictions.
#
# Live, on a small slice: one window of 256 tokens from the start of the first held-out document of each source
# (the documents are separated by `<|endoftext|>`; `heldout.names` names them):

# %%
docs = heldout_text.split("<|endoftext|>")
names = (ROOT / "data" / "corpus" / "heldout.names").read_text().split()
first = {}
for name, doc in zip(names, docs):
    first.setdefault(name.split("/")[0], (name, doc))
WINDOW = 256
windows = torch.tensor([tok.encode(doc)[:WINDOW] for _, doc in first.values()])          # [4, 256]


def cross_entropy(m, x):
    """Per-position -log p of each next token, [B, T - 1] (nats), from one forward of the windows x [B, T]."""
    with lk.use_reference(), torch.no_grad():
        logits = m.forward(x)[:, :-1].float()
    return F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")


nll = cross_entropy(model, windows)
rows = [{"source": src, "document": name, "tokens scored": WINDOW - 1, "cross-entropy": f"{row.mean():.3f}",
         "perplexity": f"{row.mean().exp():.1f}"} for (src, (name, _)), row in zip(first.items(), nll)]
rows.append({"source": "all four", "document": "", "tokens scored": nll.numel(), "cross-entropy":
             f"{nll.mean():.3f}", "perplexity": f"{nll.mean().exp():.1f}"})
print(render_table(rows))

# %% [markdown]
# The Bible, formulaic and repetitive, is the easiest to predict, Melville the hardest. For comparison, a model
# that knew only how often each token occurs (fitted on the held-out text itself, so a generous baseline), and the
# committed figure over the whole held-out set (a thousand tokens are a small sample of it):

# %%
freq = torch.bincount(torch.tensor(heldout_ids), minlength=cfg.vocab_size).float()
pf = freq[freq > 0] / freq.sum()
print(f"token frequencies only (unigram): perplexity {math.exp(float(-(pf * pf.log()).sum())):.0f}")
print(f"this slice, live:                  perplexity {nll.mean().exp():.1f} over {nll.numel():,} tokens")

# %%
# NBVAL_IGNORE_OUTPUT
quality = read_json(DEMO_MODEL / "quality.json")
quality_h200 = read_json(DEMO_MODEL / "quality.h200.json")
print(f"the whole held-out set, committed:  perplexity {quality['variants']['bf16']['perplexity']:.2f} over "
      f"{quality['variants']['bf16']['tokens_scored']:,} tokens (windows of {quality['window']})")

# %% [markdown]
# **The committed measurements.** `experiments/demo_model/quality.py` writes each variant as a checkpoint folder,
# loads it with `lynn_model` and scores the whole held-out set (216k tokens, windows of 512) on the CPU reference
# path; `--kernels` does the same on the H200's compiled kernels. Greedy agreement: 64 prompts of 16 held-out
# tokens, 32 greedy tokens each, compared with the bf16 model's. The variants:
#
# * `nvfp4-ct`, `nvfp4-modelopt`: `lynn quantize` in each layout and recipe, the modules published NVFP4
#   checkpoints quantise (attention, shared and routed experts);
# * `nvfp4-all`: the Gated DeltaNet projections too; `nvfp4-experts`: the routed experts only;
# * `int4-g32`, `int4-g128`: plain round-to-nearest int4 with a bf16 scale per 32 or 128 weights, on the same
#   modules as `nvfp4-ct` (g32 spends 4.5 bits per weight, as NVFP4 does).

# %%
# NBVAL_IGNORE_OUTPUT
variants = quality["variants"]
h200 = quality_h200["variants"]
base = variants["bf16"]["perplexity"]


def weight_bytes(v):
    if "bytes_after" in v:
        return f"{v['bytes_after'] / 1e6:.1f} MB"
    return "23.2 MB" if "bits_per_weight" not in v else f"bf16 ({v['bits_per_weight']:g} bits)"


print(f"CPU reference: {quality['date']}, git {quality['git_sha'][:7]}, torch {quality['torch']}, "
      f"{quality['seconds']:.0f} s; H200 kernels: {quality_h200['date']}, git {quality_h200['git_sha'][:7]}, "
      f"torch {quality_h200['torch']}, {quality_h200['seconds']:.0f} s")
print(render_table([{"variant": k, "weights": weight_bytes(v), "perplexity": f"{v['perplexity']:.2f}",
                     "vs bf16": "-" if k == "bf16" else f"{v['perplexity'] / base - 1:+.1%}",
                     "greedy equal": f"{v['greedy_match']:.2f}",
                     "tokens before first difference": f"{v['greedy_tokens_before_first_difference']:.1f}",
                     "H200 kernels: perplexity": f"{h200[k]['perplexity']:.2f}" if k in h200 else "not measured"}
                    for k, v in variants.items()]))
cpu_g, gpu_g = (torch.tensor(q["greedy_tokens"]["bf16"]) for q in (quality, quality_h200))
same = cpu_g == gpu_g
floor = same.float().mean().item()
floor_first = torch.where(same.all(1), same.shape[1], (~same).int().argmax(1)).float().mean().item()
print(f"\nthe same bf16 weights, CPU reference vs H200 kernels: greedy equal {floor:.2f}, "
      f"{floor_first:.1f} tokens before the first difference")

# %%
# NBVAL_IGNORE_OUTPUT
names_v = [k for k in variants if k != "bf16"]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))
xs = range(len(names_v))
colour_v = ["tab:blue" if "nvfp4" in k else "tab:green" for k in names_v]
ax1.bar(xs, [100 * (variants[k]["perplexity"] / base - 1) for k in names_v], color=colour_v)
on_h200 = [i for i, k in enumerate(names_v) if k in h200]          # the variants measured there too
ax1.plot(on_h200, [100 * (h200[names_v[i]]["perplexity"] / h200["bf16"]["perplexity"] - 1) for i in on_h200], "k_",
         ms=14, label="H200 kernels")
ax1.set_ylabel("perplexity vs bf16 (%)")
ax1.set_title("held-out perplexity cost (lower is better)", fontsize=8)
ax1.legend(fontsize=7)
ax2.bar(xs, [variants[k]["greedy_match"] for k in names_v], color=colour_v)
ax2.axhline(floor, color="k", ls="--", lw=0.8)
ax2.text(-0.4, floor + 0.02, "bf16: CPU vs H200", fontsize=7)
ax2.set_ylim(0, 1)
ax2.set_ylabel("greedy tokens equal to bf16's")
ax2.set_title("greedy agreement with bf16", fontsize=8)
for ax in (ax1, ax2):
    ax.set_xticks(list(xs), names_v, rotation=30, fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# How to read it: NVFP4 on the default modules costs this model about 1.6% in perplexity, 2.2% with the Gated
# DeltaNet projections as well, 0.7% with only the routed experts. Plain int4 with a scale per 32 weights does a
# little better at the same 4.5 bits: NVFP4's case on a Blackwell GPU is that the hardware multiplies it, not that
# it is more accurate. The compiled kernels give the reference's perplexity to within 0.03%.
#
# Greedy agreement is low for every variant, and that is mostly the model: at perplexity 39 the top two tokens
# are often nearly tied, so any perturbation flips some of them, and once one token differs the two texts go
# their own ways. Even the *same* bf16 weights on the CPU and on the H200 part after 27 tokens on average, from
# bf16 rounding alone. Perplexity is the number that measures quality; greedy agreement only says how soon two
# runs part.
#
# **Live: bf16 against NVFP4.** `lynn_model.from_pretrained(DEMO_MODEL, weights="nvfp4")` quantises the bf16
# projections to NVFP4 as it loads them (the ModelOpt recipe; the routers, gates, `in_proj_a/b` and the LM head
# stay bf16, the Gated DeltaNet projections are quantised: the modules of `nvfp4-all`). The same slice and the
# same prompt, greedy:

# %%
with lk.use_reference():
    model4 = lynn_model.from_pretrained(DEMO_MODEL, weights="nvfp4", dtype=DTYPE)
nll4 = cross_entropy(model4, windows)
print(f"the 4 windows: bf16 weights' perplexity {nll.mean().exp():.2f}, NVFP4's {nll4.mean().exp():.2f} "
      f"({nll4.mean().exp() / nll.mean().exp() - 1:+.1%})")

GREEDY = 32
with lk.use_reference():
    g16 = lynn_model.generate(model, PROMPT, GREEDY)[0, len(prompt_ids):].tolist()
    g4 = lynn_model.generate(model4, PROMPT, GREEDY)[0, len(prompt_ids):].tolist()
diff = next((i for i, (a, b) in enumerate(zip(g16, g4)) if a != b), None)
print(f"greedy, {GREEDY} tokens: the first difference at token {diff}" if diff is not None
      else f"greedy, {GREEDY} tokens: identical")


def side(tokens, at):
    out = []
    for i, t in enumerate(tokens):
        style = ("background:#f4a6a6;font-weight:bold" if i == at else "color:#999" if at is not None and i > at
                 else "")
        out.append(f'<span style="{style}">{piece(t)}</span>')
    return "".join(out)


cell = 'style="vertical-align:top;text-align:left;font-family:monospace;width:50%;padding:4px"'
display(HTML(f'<table style="width:100%"><tr><th {cell}>bf16 weights</th><th {cell}>NVFP4 (quantised on load)</th></tr>'
             f'<tr><td {cell}>{side(g16, diff)}</td><td {cell}>{side(g4, diff)}</td></tr></table>'))

# %% [markdown]
# At the first difference, both models' top candidates (the context is the same up to there):

# %%
if diff is not None:
    ctx = torch.tensor([prompt_ids + g16[:diff]])
    with lk.use_reference(), torch.no_grad():
        p16, p4 = (m.forward(ctx)[0, -1].float().softmax(-1) for m in (model, model4))
    best = p16.argsort(descending=True)[:4]
    print(f"after {tok.decode(ctx[0, -8:].tolist())!r}:")
    print(render_table([{"token": repr(tok.decode([i])), "p, bf16 weights": f"{p16[i]:.3f}", "p, NVFP4": f"{p4[i]:.3f}"}
                        for i in best.tolist()]))

# %% [markdown]
# A near-tie between the top two, which a 4-bit rounding of the weights tips the other way; from there on each
# model continues its own text, both in the same voice.
#
# ## 7. The training run
#
# `experiments/demo_model/train.py` trained the model on the H200 in one run of six minutes: AdamW, peak learning
# rate 2e-3 with warm-up and a cosine decay, batches of 32 x 512 tokens, bf16 autocast, the router's
# load-balancing loss, held-out loss every 20 s over 64 fixed windows; the weights of the best evaluation were
# kept. An earlier run of the same script (`run1_*`) with a cap of 10 epochs shows why the shipped one stops at
# six: with 4.75M tokens of training text the model is data-bound, and past about five epochs the held-out loss
# rises again while the training loss keeps falling (it memorises).

# %%
# NBVAL_IGNORE_OUTPUT
runs = {"shipped (6 epochs)": "", "run 1 (cap 10 epochs)": "run1_"}
records = {k: read_json(TRAINING / f"{p}train_record.json") for k, p in runs.items()}
logs = {k: read_jsonl(TRAINING / f"{p}train_log.jsonl") for k, p in runs.items()}
fields = [("date", lambda r: r["date"][:16].replace("T", " ")), ("GPU", lambda r: r["gpu"]),
          ("commit", lambda r: r["git_sha"]), ("torch / transformers", lambda r: f"{r['torch']} / "
                                                                                f"{r['transformers']}"),
          ("parameters", lambda r: f"{r['parameters'] / 1e6:.2f}M"), ("steps", lambda r: f"{r['steps']:,} of "
                                                                                       f"{r['batch']} x {r['seq']}"),
          ("tokens seen", lambda r: f"{r['tokens_seen'] / 1e6:.1f}M ({r['epochs']:.1f} epochs of "
                                    f"{r['train_tokens'] / 1e6:.2f}M)"),
          ("training / wall time", lambda r: f"{r['train_seconds']:.0f} s / {r['wall_seconds']:.0f} s"),
          ("throughput", lambda r: f"{r['tokens_seen'] / r['train_seconds'] / 1e3:.0f}k tokens/s"),
          ("final train loss", lambda r: f"{r['final_train_loss']:.3f} nats"),
          ("best held-out loss (step)", lambda r: f"{r['final_heldout_loss']:.3f} (step {r['best_step']:,}), "
                                                  f"perplexity {math.exp(r['final_heldout_loss']):.1f}")]
print(render_table([{"": name, **{k: f(r) for k, r in records.items()}} for name, f in fields]))
print("\nshipped run:", records["shipped (6 epochs)"]["command"])

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(6.5, 3))
for (k, log), c in zip(logs.items(), ("tab:blue", "tab:orange")):
    tr = [r for r in log if r["kind"] == "train"]
    ev = [r for r in log if r["kind"] == "eval"]
    ax.plot([r["tokens"] / 1e6 for r in tr], [r["loss"] for r in tr], color=c, lw=0.8, alpha=0.6,
            label=f"{k}: train")
    ax.plot([r["tokens"] / 1e6 for r in ev], [r["heldout_loss"] for r in ev], "o-", color=c, ms=2.5, lw=1.2,
            label=f"{k}: held-out")
    best = next(r for r in ev if r["step"] == records[k]["best_step"])
    ax.plot(best["tokens"] / 1e6, best["heldout_loss"], "*", color="k", ms=8)
epoch = records["shipped (6 epochs)"]["train_tokens"] / 1e6
for e in range(1, 10):
    ax.axvline(e * epoch, color="0.85", lw=0.6, zorder=0)
ax.set_ylim(2.3, 6)
ax.set_xlabel("tokens seen (M); grey lines: epochs; stars: the weights kept")
ax.set_ylabel("loss (nats / token)")
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# The held-out loss of the evaluation (64 windows, 3.71 nats, perplexity 40.9) is a sample of the held-out set;
# over all of it, the committed table above gives 39.3.
#
# ## 8. On the H200
#
# On a GPU `lynn generate` runs the same model on the compiled Triton kernels. The committed output
# (`data/models/lynn-demo/generate-h200.txt`) is two runs measured there: the first, 64 greedy tokens in a fresh
# process, includes compiling every kernel (hence its prefill "speed" and its 42 s); the second, 200 sampled
# tokens with `--seed 1` and the kernels in Triton's cache, is the text quoted in `docs/quantization.md`. Both were
# measured at a9532a3, before the decode step became a CUDA graph and before the present sampler: their decode
# speeds are the eager step's (host-bound: each token a few hundred small kernel launches), and `--seed 1` now
# draws other tokens (the greedy run is unchanged: the check below still holds).

# %%
# NBVAL_IGNORE_OUTPUT
runs_h200 = (DEMO_MODEL / "generate-h200.txt").read_text().split("[lynn-demo")[1:]
for run in runs_h200:
    lines = [ln for ln in ("[lynn-demo" + run).splitlines() if ln.strip()]
    header, text = lines[0], lines[1]
    stats = next(ln for ln in lines if ln.startswith("[loaded"))
    wall = next((ln.split()[1] for ln in lines if ln.startswith("real")), "?")
    print(header)
    print(wrap(text))
    print(f"{stats}\n(wall clock of the whole command: {wall})\n")

h200_greedy = runs_h200[0].splitlines()[1]
with lk.use_reference():
    cpu_greedy = lynn_model.generate(model, PROMPT, 64)[0, len(prompt_ids):].tolist()
print("the H200's greedy run and this CPU's greedy 64 tokens (torch reference), the same text:",
      h200_greedy == DEMO_PROMPT + tok.decode(cpu_greedy))

# %% [markdown]
# To reproduce on a machine with a CUDA GPU:
#
# ```
# lynn generate --seed 1                        # the demo model, the built-in prompt, 200 tokens, T 0.8 / 40 / 0.95
# lynn generate --seed 1 --temperature 0        # greedy
# lynn generate --weights nvfp4 --seed 1        # quantised to NVFP4 on load
# lynn generate "It is a truth universally acknowledged" --max-new-tokens 60
# ```
#
# Text streams to stdout, the statistics to stderr. On a CPU the same commands run the torch reference path (and
# say so); `--backend interpreter` runs the Triton kernels through Triton's interpreter instead (slow). A seed
# repeats a run on the same kind of device only: the draws' noise is the same integers everywhere, but the two
# devices' bf16 arithmetic differs in the last bits (section 6), and once one token differs the texts part, so a
# CPU run with `--seed 1` writes a different text in the same voice. The perplexity table is reproduced by `python experiments/demo_model/quality.py`
# (CPU, about 12 minutes) and `python experiments/demo_model/quality.py --kernels` (GPU, about a minute).
#
# ## 9. Talking to a running server
#
# `lynn serve` puts the model behind an OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions`
# (streamed or not), `/v1/models`, `/health` and `/metrics` (docs/serving.md). Its engine batches requests
# continuously: a request joins the running decode batch as soon as it has a cache slot and leaves it when it ends.
# Here the same server runs inside this notebook. `Server` loads the model in a thread of its own and steps the
# engine there; `create_app` is the FastAPI app over it, and `serve_in_thread` runs it on uvicorn in a background
# thread, on a free loopback port, until the model is loaded. On a CPU the server computes in float32, not bf16:
# a greedy request then gets the same tokens whatever other requests share its batch (the engine's docstring says why).
#
# This section needs the serve extra and the `openai` client (both in the test extra): `python -m pip install -e
# ".[serve]" openai`.

# %%
import contextlib

import httpx
import openai

from lynn_model.serve.http import Server, serve_in_thread

server = Server(DEMO_MODEL, rows=4)            # the demo model; float32 and the torch reference on a CPU
running = contextlib.ExitStack()               # closed at the end of this section
BASE = running.enter_context(serve_in_thread(server, timeout=120))   # once the model has loaded
client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused")   # the server checks no key
print("models:", [(m.id, m.max_model_len) for m in client.models.list()])

# %% [markdown]
# A greedy completion (`temperature=0`; OpenAI's default is 1). `max_tokens` matters more here than elsewhere: the
# engine reserves the cache pages for the whole prompt plus `max_tokens` when it admits a request. The text is the
# one `lynn_model.generate` gives the float32 model alone:

# %%
done = client.completions.create(model=server.name, prompt=DEMO_PROMPT, max_tokens=24, temperature=0)
choice = done.choices[0]
print(wrap(DEMO_PROMPT + choice.text))
print(f"finish_reason {choice.finish_reason!r}; usage: {done.usage.prompt_tokens} prompt tokens, "
      f"{done.usage.completion_tokens} completion tokens")

with lk.use_reference():
    model32 = lynn_model.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    alone = lynn_model.generate(model32, PROMPT, 24, temperature=0)[0, len(prompt_ids):].tolist()
print("the same text as generate() alone, float32:", choice.text == tok.decode(alone))

# %% [markdown]
# A chat completion, streamed: the server applies the checkpoint's chat template and sends server-sent events,
# one chunk per piece of new text (a piece waits while it could end in the middle of a character or of a stop
# string). The first chunk carries the role, the last the finish reason, and with `include_usage` one more chunk
# carries the token counts. The model was never trained on chats; what matters here is the stream:

# %%
stream = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "Call me Ishmael."}],
                                        max_tokens=12, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
for i, chunk in enumerate(stream):
    if chunk.choices:
        c = chunk.choices[0]
        print(f"chunk {i:2d}: role {c.delta.role or '-':9} content {c.delta.content!r:10} "
              f"finish_reason {c.finish_reason}")
    else:
        print(f"chunk {i:2d}: usage {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} "
              f"completion tokens")

# %% [markdown]
# Requests that arrive together share the decode steps: four prompts sent at once, each with its own
# `max_tokens`. Each one still gets the tokens it gets alone:

# %%
from concurrent.futures import ThreadPoolExecutor

asks = [("It is a truth universally acknowledged", 20), ("In the beginning", 12),
        ("The whale", 16), ("Mr. Darcy said", 8)]


def complete(ask):
    text, n = ask
    return client.completions.create(model=server.name, prompt=text, max_tokens=n, temperature=0).choices[0].text


with ThreadPoolExecutor(len(asks)) as pool:
    texts = list(pool.map(complete, asks))
with lk.use_reference():
    for (text, n), got in zip(asks, texts):
        ids = torch.tensor([tok.encode(text)])
        own = tok.decode(lynn_model.generate(model32, ids, n, temperature=0)[0, ids.shape[1]:].tolist())
        print(f"{text + got!r}\n    the same as alone: {got == own}")

# %% [markdown]
# `/metrics` is Prometheus text: counters since the server started, gauges as they are now, and histograms of the
# time to the first token and between tokens (timings, not shown). The requests so far, and the cache: every slot
# and page is free again, since each request's slot is released when it ends:

# %%
metrics = httpx.get(f"{BASE}/metrics").text
for line in metrics.splitlines():
    if line.startswith(("lynn_requests", "lynn_prompt_tokens", "lynn_generation_tokens", "lynn_cache")):
        print(line)

# %% [markdown]
# A parameter the engine cannot honour is refused, never ignored: `n=2` (two completions per prompt) gets a 400 with
# OpenAI's error JSON, which the `openai` client raises as `BadRequestError`. So do `logprobs`, penalties, tools and
# any parameter the server does not know:

# %%
r = httpx.post(f"{BASE}/v1/completions", json={"model": server.name, "prompt": DEMO_PROMPT, "n": 2})
print(r.status_code, json.dumps(r.json(), indent=2))
try:
    client.completions.create(model=server.name, prompt=DEMO_PROMPT, n=2)
except openai.BadRequestError as err:
    print(f"the openai client raises {type(err).__name__} ({err.status_code})")

# %% [markdown]
# Stopping: uvicorn finishes, then the app's shutdown stops the engine thread.

# %%
running.close()
print("engine thread stopped:", not server.thread.is_alive())

# %% [markdown]
# From a terminal the same server is `lynn serve` (the demo model on `http://127.0.0.1:8000`); docs/serving.md has
# its flags, the parameters it takes and refuses, and how the engine schedules.
#
# ## What's next
#
# The demo model makes the cost of the format measurable: 1.6% in perplexity for the default NVFP4 targets.
# `docs/quantization.md` has the whole record (corpus, tokenizer, training, the table); `docs/decoder.md` the
# decoder the model runs on, and docs/history/decode.md the decode step as a CUDA graph on the H200;
# docs/serving.md the server of section 9.
