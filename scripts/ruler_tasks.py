"""RULER's synthetic tasks, generated locally (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", §3 and its appendix's templates; NVIDIA/RULER's synthetic.yaml settings).

  niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery: needles "One of the special magic
      {numbers|words|uuids} for {key} is: {value}." in a haystack of repeated noise sentences, of essay text, or of
      other needles; the question asks for the values of one key (of four, for multi-query).
  vt: variable tracking, a chain of 4 hops (VAR A = 12345, VAR B = VAR A, ...) in noise; the answer is every
      variable that holds the value.
  cwe: common words extraction, the 10 words a numbered list repeats 30 times among words it repeats 3 times.
  fwe: frequent words extraction, the 3 most frequent coded words of a text drawn from a Zipf law (alpha 2).

Essay haystacks are the license texts in /usr/share/common-licenses (RULER uses Paul Graham's essays; nothing is
downloaded here); words come from the same texts. A sample is a function of (task, length, index) alone: the same
seed gives the same prompt on every machine. The prompt is fitted to `length` tokens of the model (a
count_tokens callable) less the tokens the answer may take, as RULER fits its haystacks.

Scoring is RULER's string_match_all: the share of the expected strings found in the answer, case-insensitive.
"""
import os
import random
import re
import uuid

LICENSES = ["GPL-3", "GPL-2", "LGPL-2.1", "GFDL-1.3", "MPL-1.1", "MPL-2.0", "Apache-2.0", "GPL-1", "LGPL-3",
            "CC0-1.0", "Artistic", "BSD"]
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NIAH_TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz "
                 "you about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} "
                 "mentioned in the provided text?")
NIAH_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"

# RULER's synthetic.yaml: haystack, key and value kinds, needle counts.
TASKS = {
    "niah_single_1": dict(kind="niah", haystack="noise", key="words", value="numbers"),
    "niah_single_2": dict(kind="niah", haystack="essay", key="words", value="numbers"),
    "niah_single_3": dict(kind="niah", haystack="essay", key="words", value="uuids"),
    "niah_multikey_1": dict(kind="niah", haystack="essay", key="words", value="numbers", keys=4),
    "niah_multikey_2": dict(kind="niah", haystack="needle", key="words", value="numbers"),
    "niah_multikey_3": dict(kind="niah", haystack="needle", key="uuids", value="uuids"),
    "niah_multivalue": dict(kind="niah", haystack="essay", key="words", value="numbers", values=4),
    "niah_multiquery": dict(kind="niah", haystack="essay", key="words", value="numbers", keys=4, queries=4),
    "vt": dict(kind="vt", chains=1, hops=4),
    "cwe": dict(kind="cwe", freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": dict(kind="fwe", alpha=2.0),
}
ANSWER_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's tokens_to_generate


def _texts(folder="/usr/share/common-licenses"):
    return [open(os.path.join(folder, name), encoding="utf-8", errors="replace").read() for name in LICENSES
            if os.path.exists(os.path.join(folder, name))]


_CACHE = {}


def essay_sentences():
    if "sentences" not in _CACHE:
        text = " ".join(" ".join(t.split()) for t in _texts())
        _CACHE["sentences"] = [s for s in re.split(r"(?<=[.!?;:])\s+", text) if s]
    return _CACHE["sentences"]


def vocabulary():
    """Distinct lower-case words of 4 to 10 letters from the texts, in a fixed order."""
    if "words" not in _CACHE:
        seen = dict.fromkeys(w for w in re.findall(r"\b[a-z]{4,10}\b", " ".join(_texts()).lower()))
        _CACHE["words"] = sorted(seen)
    return _CACHE["words"]


def _key(rng, kind, taken):
    while True:
        if kind == "words":
            words = vocabulary()
            k = f"{rng.choice(words)}-{rng.choice(words)}"
        elif kind == "numbers":
            k = str(rng.randint(10 ** 6, 10 ** 7 - 1))
        else:
            k = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if k not in taken:
            taken.add(k)
            return k


def _insert(units, items, rng):
    """units with each item inserted at a random depth (between units), in order of depth."""
    at = sorted(rng.randint(0, len(units)) for _ in items)
    out, last = [], 0
    for depth, item in zip(at, items):
        out += units[last:depth] + [item]
        last = depth
    return out + units[last:]


def _niah(spec, rng, size):
    """size: haystack units. Returns (context, query, answers, kind)."""
    kind = spec["value"]
    taken = set()
    keys = [_key(rng, spec["key"], taken) for _ in range(spec.get("keys", 1))]
    values = [[_key(rng, kind, taken) for _ in range(spec.get("values", 1))] for _ in keys]
    needle = "One of the special magic {kind} for {key} is: {value}."
    needles = [needle.format(kind=kind, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    if spec["haystack"] == "noise":
        units = [NOISE] * size
    elif spec["haystack"] == "essay":
        sentences = essay_sentences()
        start = rng.randrange(len(sentences))
        units = [sentences[(start + i) % len(sentences)] for i in range(size)]
    else:  # other needles: distractor keys with their own values
        units = [needle.format(kind=kind, key=_key(rng, spec["key"], taken), value=_key(rng, kind, taken))
                 for _ in range(size)]
    context = " ".join(_insert(units, needles, rng))
    queried = rng.sample(range(len(keys)), spec.get("queries", 1))
    query = ", ".join(keys[q] for q in queried)
    answers = [v for q in queried for v in values[q]]
    prompt = NIAH_TEMPLATE.format(kind=kind, context=context, query=query)
    return prompt, NIAH_ANSWER.format(kind=kind, query=query), answers


def _vt(spec, rng, size):
    taken = set()
    names = lambda: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
    chains, answers, query = [], [], None
    for c in range(spec["chains"]):
        value = str(rng.randint(10000, 99999))
        chain = []
        while len(chain) < spec["hops"] + 1:
            n = names()
            if n not in taken:
                taken.add(n)
                chain.append(n)
        lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, len(chain))]
        chains.append(lines)
        if c == 0:
            query, answers = value, chain
    units = [NOISE] * size
    # Each chain's statements in order, at increasing depths.
    statements = [s for lines in chains for s in lines]
    context = " ".join(_insert(units, statements, rng))
    prompt = VT_TEMPLATE.format(context=context, query=query)
    return prompt, VT_ANSWER.format(n=len(answers), query=query), answers


def _cwe(spec, rng, size):
    words = rng.sample(vocabulary(), spec["num_cw"] + max(size, 1))
    common, rare = words[:spec["num_cw"]], words[spec["num_cw"]:spec["num_cw"] + size]
    listed = common * spec["freq_cw"] + rare * spec["freq_ucw"]
    rng.shuffle(listed)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
    return CWE_TEMPLATE.format(context=context), CWE_ANSWER, common


def _fwe(spec, rng, size):
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 7))) for _ in range(
        max(size // 4, 50))]
    ranks = range(1, len(vocab) + 1)
    weights = [r ** -spec["alpha"] for r in ranks]
    drawn = rng.choices(vocab, weights=weights, k=size)
    context = " .... ".join(drawn)
    counts = {}
    for w in drawn:
        counts[w] = counts.get(w, 0) + 1
    top = sorted(counts, key=lambda w: (-counts[w], vocab.index(w)))[:3]
    return FWE_TEMPLATE.format(context=context), FWE_ANSWER, top


MAKERS = {"niah": _niah, "vt": _vt, "cwe": _cwe, "fwe": _fwe}


def sample(task, length, index, count_tokens, render=lambda prompt, answer: prompt + answer):
    """Sample `index` of `task` fitted to `length` tokens: the largest haystack whose rendered prompt
    (render(prompt, answer prefix): the chat template around the question, the answer prefix after it) takes
    at most length - ANSWER_TOKENS tokens. Returns dict(task, length, index, prompt, answers, tokens)."""
    spec = TASKS[task]
    make = MAKERS[spec["kind"]]
    limit = length - ANSWER_TOKENS[spec["kind"]]

    def build(size):
        rng = random.Random(f"ruler/{task}/{length}/{index}")
        prompt, answer, answers = make(spec, rng, size)
        text = render(prompt, answer)
        return text, answers, count_tokens(text)

    lo, hi = 1, max(2, length // 4)
    while build(hi)[2] <= limit:  # grow until it no longer fits
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if build(mid)[2] <= limit:
            lo = mid
        else:
            hi = mid
    text, answers, tokens = build(lo)
    return {"task": task, "length": length, "index": index, "prompt": text, "answers": answers, "tokens": tokens}


def string_match_all(prediction, answers):
    """RULER's score of one sample: the share of the answers found in the prediction, case-insensitive."""
    p = prediction.lower()
    return sum(a.lower() in p for a in answers) / len(answers)
