"""Build the default labelled prompt set from local material, deterministically.

No network and no downloaded corpora: code comes from source files on the machine
(the Python standard library, examples under /usr/share/doc), prose from local
documentation (READMEs, release notes, module docstrings); structured-output, chat
and creative prompts are generated from seeded templates whose slots are filled with
words from that material. The caller (``specpilot classify build-dataset``) reads the
files; this module is pure: documents in, labelled rows out.

Honest held-out split: every document origin (one package's documentation, one
standard-library module) and every entry of each template, instruction, opener and
topic list is first assigned to train or test (``HELD_OUT_SHARE`` of each, by a seeded
shuffle), and a row is built only from parts of its own side. A held-out prompt thus
never shares its source package, its instruction wording or its topic with a training
prompt (only the short lists of programming-language names and song genres are
shared), so the macro-F1 on it measures generalisation to new phrasings and sources,
not recall of near-copies. The price is variance: which templates land in the held-out
part moves the score by a few points (``bench.classifier --resplit-seeds`` shows it).

The same documents and seed give byte-identical rows; other machines' material gives
other rows, which is why the built set is committed rather than rebuilt on install.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

Split = Literal["train", "test"]
DocumentKind = Literal["code", "prose"]

HELD_OUT_SHARE = 0.3
"""Share of documents and of each template list reserved for the held-out split."""

ROWS_PER_CLASS = 320
"""Rows generated per default class (train and test together)."""

MAX_PASSAGE_CHARS = 900
MAX_CODE_LINES = 36

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SourceDocument:
    """One local file's text. ``name`` is ``<source>:<path>`` (``doc:git/README.md``);
    its origin (see :func:`document_origin`) decides the document's split."""

    name: str
    text: str
    kind: DocumentKind
    language: str
    """For code: "python", "c", "awk", "shell", "perl", ...; for prose: "text"."""


@dataclass(frozen=True, slots=True)
class DatasetRow:
    """One labelled prompt with the group it was built from and its split."""

    prompt: str
    workload_class: str
    temperature: float | None
    group: str
    split: Split


def row_to_json(row: DatasetRow) -> str:
    """One JSON line of the committed dataset."""
    return json.dumps(
        {
            "prompt": row.prompt,
            "class": row.workload_class,
            "temperature": row.temperature,
            "group": row.group,
            "split": row.split,
        },
        ensure_ascii=False,
        sort_keys=True,
    )


# --- templates --------------------------------------------------------------------
# Each list is split into train/test parts; wording in the held-out part never
# appears in training prompts.

CODE_INSTRUCTIONS = [
    "Complete the following {lang} code.",
    "Find the bug in this {lang} code and fix it:",
    "Add type annotations and docstrings to this code:",
    "Write unit tests for the {lang} code below.",
    "Refactor this function to be more readable. Keep the behaviour identical.",
    "Continue this {lang} file:",
    "Rewrite this {lang} code in Rust.",
    "Why does this code raise an exception on empty input?",
    "Optimise the following snippet for speed:",
    "Review this code and point out problems:",
    "Port the following {lang} code to Go.",
    "Add error handling to this code:",
    "Convert the loop below into a more idiomatic form.",
    "Explain line by line what this {lang} code does.",
    "",
    "# TODO: finish the implementation below",
    "What is the time complexity of this code?",
    "This {lang} code is slow on big inputs. Improve it:",
    "Document this code for other developers:",
    "Rename the variables in this code to clearer names:",
    "Does this code handle edge cases? Fix what it misses.",
    "Write a docstring for the following:",
    "Make this code thread-safe:",
    "Add logging to every branch of this {lang} code.",
    "Simplify this code without changing its output:",
    "Write the missing function that this code calls.",
]

CODE_TASKS = [
    "parses a CSV file and returns the average of the third column",
    "reverses a singly linked list in place",
    "checks whether a string is a palindrome, ignoring punctuation",
    "merges two sorted arrays into one sorted array",
    "computes the Levenshtein distance between two strings",
    "implements an LRU cache with get and put in O(1)",
    "reads a JSON config file and validates required keys",
    "retries an HTTP request with exponential backoff",
    "finds all prime numbers below n with a sieve",
    "flattens an arbitrarily nested list",
    "counts word frequencies in a text file and prints the top ten",
    "serialises a binary tree to a string and back",
    "rate-limits calls to a function with a token bucket",
    "walks a directory tree and reports duplicate files by hash",
    "converts a Roman numeral to an integer",
    "implements binary search over a sorted list",
    "computes a moving average over a stream of numbers",
    "validates an email address with a regular expression",
    "schedules tasks respecting their dependencies (topological sort)",
    "parses command-line flags and prints usage on error",
    "tokenises an arithmetic expression and evaluates it",
    "deduplicates records by key keeping the newest one",
    "implements a thread pool with a bounded queue",
    "computes the SHA-256 of a large file in chunks",
    "parses ISO-8601 timestamps and converts them to UTC",
    "implements a trie with insert and prefix search",
    "batches items into groups of n and processes them concurrently",
    "computes the shortest path in a weighted graph with Dijkstra's algorithm",
    "renders a table of rows as aligned plain text columns",
    "diffs two lists and reports added and removed items",
    "watches a file for changes and reloads its contents",
    "encodes and decodes base64 without using a library",
]

CODE_REQUESTS = [
    "Write a {lang} function that {task}.",
    "Implement a function in {lang} which {task}. Include tests.",
    "I need {lang} code that {task}. Please keep it short.",
    "Give me a {lang} class that {task}, with docstrings.",
    "Can you write a small {lang} script that {task}?",
    "Show an efficient {lang} implementation that {task}.",
    "def solution():\n    # {task}\n",
    "// {lang}: a function that {task}\n",
    "Using only the standard library, write {lang} code that {task}.",
    "Write a command-line tool in {lang} that {task}.",
    "How would I write code in {lang} that {task}? Show the full implementation.",
    "Generate {lang} code: a module that {task}, plus a main() demo.",
    "Please implement, in idiomatic {lang}, a routine that {task}.",
    'class Solution:\n    """{task}"""\n',
    "/* TODO: {task} */\nint main(void) {{\n",
    "Write a {lang} unit-tested helper that {task}; use type hints where possible.",
    "Sketch the {lang} API and implementation for something that {task}.",
    "My {lang} program needs a function that {task}. Write it with comments.",
    "Write {lang} code which {task}. Return only the code block.",
    "Implement this in {lang}: a function that {task}. Handle edge cases and add tests.",
    "Code challenge ({lang}): write a function that {task}. Aim for O(n log n) or better.",
    "```{lang}\n// function that {task}\n```\nFill in the body.",
    "Could you code up something in {lang} that {task}? I'll paste it into my repo.",
    "Need a quick {lang} snippet: {task}. No explanations, just code.",
    "Write a {lang} function signature and body for a helper that {task}.",
    "Show me how to write a {lang} method that {task}, using the standard library.",
    "In {lang}, how do I write a function that {task}? Please include example usage.",
    "Write a pytest-tested Python function that {task}.",
]

CODE_LANGUAGES = ["Python", "Go", "Rust", "TypeScript", "Java", "C", "C++", "Kotlin"]

STRUCTURED_TEMPLATES = [
    "Return only a JSON object with the keys {keys} describing {subject}.",
    "Convert this record to JSON:\n{record}",
    "Extract {fields} from the text below. Answer with JSON matching this schema:\n"
    "{schema}\n\nText:\n{passage}",
    "Fill in this JSON template for {subject} and output nothing else:\n{template}",
    "Produce a JSON array of {n} items about {subject}; each item has the fields {keys}.",
    'Given this JSON, add a field "{extra}" and return the updated JSON only:\n{json}',
    "Convert the following CSV to a JSON list of objects:\n{csv}",
    'Respond in JSON with keys "answer" and "confidence". Question: what is {subject}?',
    "Output a YAML document with {keys} for {subject}.",
    'Validate this JSON against the schema and return {{"valid": bool, "errors": [...]}}:\n'
    "Schema: {schema}\nDocument: {json}",
    "Turn these key/value pairs into a JSON object:\n{record}",
    "Generate a JSON Schema for objects with the fields {keys}.",
    'Classify {subject} and reply strictly as JSON: {{"label": ..., "reason": ...}}',
    "Create a JSON config for {subject} with {n} entries. No prose.",
    "Parse this log line into JSON with fields {keys}:\n{logline}",
    "Map the following table to JSON:\n{csv}",
    "Return a JSON list of the {n} most important terms in this text:\n{passage}",
    'Emit a function-call object {{"name": "{extra}", "arguments": {{...}}}} for: {subject}',
    "Output strictly valid JSON (no markdown) listing {n} examples of {subject} with {keys}.",
    "Reformat this data as JSON lines, one object per row:\n{csv}",
    'Reply with a JSON object {{"sentiment": "positive|negative", "score": 0-1}} for:\n{passage}',
    "Build the request payload (JSON) for an API that creates {subject}; fields: {keys}.",
    "Normalise this object's keys to snake_case and return JSON:\n{json}",
    "Return an array of objects with {keys}, one for each item mentioned here:\n{passage}",
    "Give me the JSON representation of this record, with correct types:\n{record}",
    "Write the OpenAPI schema component (JSON) for {subject} with properties {keys}.",
    'Summarise into JSON: {{"title": str, "keywords": [str], "summary": str}}.\n{passage}',
    "Return a GeoJSON Feature for {subject}.",
    "Respond with JSON only. Keys: {keys}. Subject: {subject}.",
    "Extract every date and amount from this text as a JSON array of objects:\n{passage}",
    "Here is a record:\n{record}\nReturn it as a JSON object, numbers as numbers.",
    "Write a JSON fixture with {n} sample records for tests; fields {keys}.",
    "Given the schema {schema}, produce one valid instance for {subject}.",
    "Transform this JSON into a flat object with dotted keys:\n{json}",
    'Answer as {{"items": [...], "count": int}} listing {n} examples of {subject}.',
    "Emit the settings below as a JSON document with the same keys:\n{record}",
]

EDIT_TEMPLATES = [
    "Rewrite the following paragraph in plain English:\n\n{passage}",
    "Fix the spelling and grammar in this text. Change nothing else.\n\n{passage}",
    "Using only the context below, answer the question.\n\nContext:\n{passage}\n\n"
    "Question: What does the text say about {term}?",
    "Summarise the document below in three bullet points.\n\n{passage}",
    "Make this passage shorter while keeping every fact:\n{passage}",
    "Here is a section of documentation. Update it so that it also mentions {term}.\n\n{passage}",
    "[Document 1]\n{passage}\n\n[Document 2]\n{passage2}\n\nBased on the documents above, "
    "explain {term}.",
    "Translate this text into German, keeping the formatting:\n{passage}",
    "Change the tone of this text to be more formal:\n\n{passage}",
    "Proofread:\n{passage}",
    "Answer from the passage only; say 'not stated' otherwise.\nPassage: {passage}\n"
    "Q: how is {term} used?",
    "Replace every mention of {term} with {term2} in the text below and return it.\n\n{passage}",
    "Edit this release note so it reads well for end users:\n{passage}",
    "Condense the following into a single paragraph:\n{passage}",
    "Retrieved context:\n---\n{passage}\n---\nUser question: is {term} covered? Cite the text.",
    "Turn this text into a numbered list of steps:\n{passage}",
    "Please copy-edit the following and mark your changes in bold.\n{passage}",
    "Rewrite for a beginner audience:\n\n{passage}",
    "Improve the clarity of this paragraph without adding information:\n{passage}",
    "Below is an excerpt from the manual.\n\n{passage}\n\nAccording to the excerpt, what is "
    "{term}?",
    "Paraphrase the following text:\n{passage}",
    "Shorten this to half its length:\n\n{passage}",
    "Context: {passage}\n\nUsing the context, write a one-line answer: why {term}?",
    "Rewrite the text below in the active voice.\n\n{passage}",
    "Correct any factual or typographical errors in the following:\n{passage}",
    "Here are search results:\n1. {passage}\n2. {passage2}\nAnswer the user: what about {term}?",
    "Restructure this paragraph so the main point comes first.\n{passage}",
    "Rewrite this as an email to my team:\n\n{passage}",
    "Make the following text sound friendlier, same content:\n\n{passage}",
    "Knowledge base article:\n{passage}\n\nCustomer question: how does {term} work? Answer from"
    " the article only.",
    "Simplify the wording of this paragraph for non-native speakers:\n{passage}",
    "Edit for brevity. Keep technical terms like {term} unchanged.\n\n{passage}",
    'Source text:\n"""\n{passage}\n"""\nWhat does the source say about {term}? Quote it.',
    "Rewrite the paragraph below replacing jargon with everyday words.\n\n{passage}",
    "Read the text and list its main claims as short sentences:\n{passage}",
    "Fix the punctuation in this passage:\n{passage}",
]

CHAT_TEMPLATES = [
    "Hi! Can you explain what {topic} is in simple terms?",
    "What's the difference between {topic} and {topic2}?",
    "I'm thinking about {activity}. Any advice?",
    "How do I get better at {activity}?",
    "Thanks, that helped. One more question: why does {topic} matter?",
    "Give me a few tips for {activity}.",
    "Is it a good idea to learn about {topic} before {activity}?",
    "Can you recommend how to start with {topic}?",
    "My friend says {topic} is overrated. What do you think?",
    "hey, quick question - what is {topic} used for?",
    "What are the pros and cons of {activity}?",
    "I have a week off. Should I spend it {activity}?",
    "Could you help me understand {topic}? I keep getting confused.",
    "What would you say to someone who is nervous about {activity}?",
    "Tell me something interesting about {topic}.",
    "Who usually cares about {topic}, and why?",
    "Is {topic} still relevant today?",
    "How long does it take to get comfortable with {activity}?",
    "What do most people get wrong about {topic}?",
    "Can we talk about {topic} for a bit?",
    "I just started {activity} and I'm a bit lost. Where should I begin?",
    "Do you think {topic} will change much in the next ten years?",
    "My partner wants us to try {activity}. How do I bring up my doubts?",
    "In your opinion, is {topic} worth the hype?",
    "What questions should I ask before {activity}?",
    "Explain {topic} like I'm five.",
    "Why do people disagree so much about {topic}?",
    "How would you summarise {topic} in one sentence?",
    "Any book or podcast recommendations on {topic}?",
    "I failed at {activity} last year. Should I try again?",
    "What's a realistic first goal for {activity}?",
    "Is there a simple way to think about {topic}?",
    "How do {topic} and {topic2} relate to each other?",
    "What are common beginner mistakes in {activity}?",
    "Which matters more in the long run, {topic} or {topic2}?",
    "I'm curious: how did {topic} become popular?",
]

CHAT_OPENERS = [
    "",
    "",
    "Hello!",
    "Hey there.",
    "Good morning!",
    "Quick one:",
    "Sorry if this is a silly question.",
    "I was wondering about something.",
    "Hi, hope you're well.",
    "Okay, so",
    "Random question:",
    "I need some advice.",
]

CHAT_CLOSERS = [
    "",
    "",
    "Thanks!",
    "Keep it brief please.",
    "What do you think?",
    "Thanks in advance.",
    "I'd love your honest take.",
    "Cheers.",
    "No need for a long answer.",
    "Appreciate it!",
]

CHAT_TURNS = [
    "Sure, I'd be happy to help with that.",
    "Good question. In short, it depends on what you need.",
    "That's a common concern; many people feel the same way.",
    "Here is a brief overview to get you started.",
    "Great, let me know if you want more detail.",
    "I understand. Let's take it step by step.",
    "Happy to! What would you like to know first?",
    "Absolutely. The short answer is yes, with a few caveats.",
    "Fair point. Many would agree with you.",
    "Glad that was useful!",
    "Honestly, there's no single right answer here.",
    "Of course. Here's how I'd think about it.",
    "That's a great question to ask early on.",
    "Let me try a different angle.",
    "You're welcome! Anything else on your mind?",
    "It varies a lot from person to person.",
]

EVERYDAY_TOPICS = [
    "sourdough baking",
    "compound interest",
    "jet lag",
    "houseplants",
    "marathon training",
    "meditation",
    "public speaking",
    "electric cars",
    "learning a language",
    "budget travel",
    "home composting",
    "chess openings",
    "sleep hygiene",
    "birdwatching",
    "job interviews",
    "remote work",
    "photography",
    "renting an apartment",
    "time management",
    "climbing",
    "vegetarian cooking",
    "podcasting",
    "saving for retirement",
    "moving to a new city",
    "inflation",
    "coffee brewing",
    "volcanoes",
    "the Roman empire",
    "jazz",
    "black holes",
    "minimalism",
    "urban cycling",
    "board games",
    "first aid",
    "tea ceremonies",
    "the ocean tides",
    "autumn leaves",
    "old bicycles",
    "city pigeons",
    "thunderstorms",
]

ACTIVITIES = [
    "learning to cook",
    "running a half marathon",
    "switching careers",
    "adopting a dog",
    "starting a garden",
    "writing a blog",
    "travelling alone",
    "learning the guitar",
    "volunteering",
    "going back to university",
    "hiking in the mountains",
    "asking for a raise",
    "painting with watercolours",
    "building a budget",
    "studying for exams",
    "camping with kids",
    "learning to swim as an adult",
    "baking bread at home",
    "planning a wedding",
    "decluttering the house",
    "starting a podcast",
    "training for a triathlon",
    "learning to draw",
    "working from a café",
    "cooking for a big family",
    "buying a used car",
    "keeping a journal",
    "teaching my kid to read",
]

CREATIVE_TEMPLATES = [
    "Write a short poem about {subject}.",
    "Tell me a story about a {character} who {event}.",
    "Write a haiku about {subject}.",
    "Compose song lyrics about {subject} in the style of {genre}.",
    "Imagine {scenario}. Describe it vividly, in the present tense.",
    "Continue this story: {opening}",
    "Write a limerick about a {character}.",
    "Invent a myth that explains {subject}.",
    "Write a dialogue between a {character} and {subject}.",
    "Write a bedtime story for a child about {subject}.",
    "Describe {subject} as if it were a character in a fairy tale.",
    "Write a sonnet in which {subject} speaks to the moon.",
    "Pitch me a science-fiction novel where {scenario}.",
    "Write flash fiction (under 200 words) that begins: {opening}",
    "Give me a villain's monologue about {subject}.",
    "Write a love letter from a {character} to {subject}.",
    "Create a riddle whose answer is {subject}.",
    "Write the opening paragraph of a mystery where {scenario}.",
    "Write a free-verse poem from the point of view of {subject}.",
    "Tell a fable with a moral about a {character} and {subject}.",
    "Write a ballad about a {character} who {event}.",
    "Describe a dream in which {scenario}, using rich sensory detail.",
    "Write a eulogy for {subject}, funny but touching.",
    "Create a short screenplay scene where a {character} {event}.",
    "Write an ode to {subject}.",
    "Write diary entries for three days in the life of a {character}.",
    "Spin a tall tale about {subject}, the more absurd the better.",
    "Write a postcard from a world where {scenario}.",
    "Write a ghost story that starts with: {opening}",
    "Write a prose poem about {subject} at dusk.",
    "Retell the legend of a {character} who {event}, as an epic poem.",
    "Invent a holiday celebrating {subject} and describe its traditions.",
    "Write a monologue for a {character} standing in the rain.",
    "Write a children's rhyme about {subject}.",
]

CREATIVE_OPENERS = [
    "",
    "",
    "Be imaginative.",
    "Surprise me!",
    "Something whimsical please:",
    "Let's get creative.",
    "For my writing group:",
    "I need inspiration.",
    "Make it emotional.",
    "Just for fun:",
]

CREATIVE_CLOSERS = [
    "",
    "",
    "Make it rhyme.",
    "Use vivid imagery.",
    "Give it a twist ending.",
    "Keep it under 150 words.",
    "Make it melancholic.",
    "Use a playful tone.",
    "Avoid clichés.",
    "Write it in the second person.",
]

CHARACTERS = [
    "lighthouse keeper",
    "retired astronaut",
    "shy dragon",
    "clockmaker",
    "talking cat",
    "time traveller",
    "street musician",
    "young witch",
    "lost robot",
    "pirate captain",
    "night-shift nurse",
    "beekeeper",
    "detective",
    "ghost",
]

EVENTS = [
    "finds a door that was not there yesterday",
    "loses their memory every sunset",
    "must deliver a letter across a frozen sea",
    "wakes up in a world without colour",
    "befriends a storm",
    "discovers the stars are going out one by one",
    "inherits a library that rearranges itself",
    "hears music no one else can",
    "is chosen to guard the last tree",
    "trades their shadow for a wish",
]

GENRES = ["a sea shanty", "a blues song", "a lullaby", "an 80s power ballad", "folk", "opera"]

OPENINGS = [
    "The rain had been falling upward since Tuesday.",
    "Nobody in the village remembered who built the tower.",
    "She found the map folded inside a library book.",
    "The last train left without its driver.",
    "Every mirror in the house showed a different season.",
    "On the morning of the eclipse, the birds went silent.",
    "He kept a jar of thunder on his windowsill.",
    "The city forgot its own name overnight.",
    "There were exactly seven doors, and one was warm.",
    "The robot had never been told how to dream.",
]

SCENARIOS = [
    "the oceans turn to glass",
    "cats run the government",
    "gravity reverses for one hour each day",
    "a town where everyone speaks in rhyme",
    "the moon sends a message",
    "humans can hear plants",
    "a library that exists only at night",
    "time moves backwards in one valley",
    "dreams can be traded at a market",
    "the last human meets the first alien",
]

FIELD_NAMES = [
    "id",
    "name",
    "email",
    "created_at",
    "price",
    "quantity",
    "status",
    "tags",
    "owner",
    "priority",
    "title",
    "author",
    "year",
    "city",
    "country",
    "score",
    "version",
    "enabled",
    "timeout_ms",
    "url",
    "description",
    "category",
    "latitude",
    "longitude",
    "sku",
    "currency",
]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_PARAGRAPH_SPLIT = re.compile(r"\n\s*\n")
_TERM = re.compile(r"\b[a-z][a-z]{4,11}\b")
_CODE_PUNCTUATION = re.compile(r"[=();{}\[\]:]")
_COMMENT_STARTS = ("#", "*", "/*", "//", '"""', "'''", "%", ";")
_PYTHON_START = re.compile(r"^(def |class |async def )")
_STOPWORD_TEXT = (
    "about above after again against because before being below between could doing "
    "during further having itself might other ought should their theirs there these "
    "those through under until where which while would your yours shall using used "
    "also this that with from have will when what them than then they were been into "
    "only some such more most must make made each many much very does "
)
# Frequent words that make poor topics.
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())


def _split_list(items: Sequence[T], rng: random.Random) -> tuple[list[T], list[T]]:
    """Seeded train/test partition of a list; both parts non-empty when len >= 2."""
    shuffled = list(items)
    rng.shuffle(shuffled)
    n_test = max(1, round(len(shuffled) * HELD_OUT_SHARE)) if len(shuffled) >= 2 else 0
    return shuffled[n_test:], shuffled[:n_test]


def document_origin(name: str) -> str:
    """The package or module a document comes from: ``doc:git/RelNotes/2.0.txt`` → ``doc:git``.

    Documents of one origin (say, all of git's release notes) read alike, so they are
    kept on one side of the split.
    """
    return name.split("/", 1)[0]


def _template_group(kind: str, templates: Sequence[str], template: str) -> str:
    """Group name of a row built from a template: ``template:chat#4`` (no '/' in it)."""
    return f"template:{kind}#{templates.index(template)}"


def _project(document: SourceDocument) -> str:
    return document_origin(document.name).split(":", 1)[-1].removesuffix(".py")


def _split_by_origin(
    documents: Sequence[SourceDocument], rng: random.Random
) -> tuple[list[SourceDocument], list[SourceDocument]]:
    origins = sorted({document_origin(d.name) for d in documents})
    _, test_origins = _split_list(origins, rng)
    held_out = set(test_origins)
    return (
        [d for d in documents if document_origin(d.name) not in held_out],
        [d for d in documents if document_origin(d.name) in held_out],
    )


@dataclass(frozen=True, slots=True)
class _Side:
    """The material and wording available to one split."""

    split: Split
    code_documents: list[SourceDocument]
    prose_documents: list[SourceDocument]
    lists: dict[str, list[str]]


def _excerpt(passage: str, rng: random.Random) -> str:
    """A whole paragraph, or (a third of the time) only its first sentence or two: RAG
    contexts and edit requests come short as well as long."""
    if rng.random() >= 1 / 3:
        return passage
    sentences = _SENTENCE_END.split(passage)
    return " ".join(sentences[: rng.randint(1, 2)])


def _passages(document: SourceDocument) -> list[str]:
    """Paragraphs of prose (mostly letters) of a usable length."""
    out: list[str] = []
    for paragraph in _PARAGRAPH_SPLIT.split(document.text):
        text = paragraph.strip()
        if not 160 <= len(text) <= MAX_PASSAGE_CHARS * 2:
            continue
        letters = sum(ch.isalpha() for ch in text)
        if letters / len(text) < 0.65:
            continue
        out.append(text[:MAX_PASSAGE_CHARS])
    return out


def _terms(text: str) -> list[str]:
    counts: dict[str, int] = {}
    for word in _TERM.findall(text.lower()):
        if word not in _STOPWORDS:
            counts[word] = counts.get(word, 0) + 1
    return sorted(counts, key=lambda w: (-counts[w], w))[:40]


def _code_chunk(document: SourceDocument, rng: random.Random) -> str | None:
    lines = document.text.splitlines()
    if len(lines) < 8:
        return None
    starts = [i for i, line in enumerate(lines) if _PYTHON_START.match(line.lstrip())]
    start = rng.choice(starts) if starts and rng.random() < 0.7 else rng.randrange(len(lines))
    chunk = lines[start : start + rng.randint(8, MAX_CODE_LINES)]
    body = [line.strip() for line in chunk if line.strip()]
    comments = sum(1 for line in body if line.startswith(_COMMENT_STARTS))
    code_like = sum(1 for line in body if _CODE_PUNCTUATION.search(line))
    # Licence headers and comment blocks are prose in code's clothing: skip them.
    if len(body) < 5 or comments > len(body) / 3 or code_like < len(body) / 2:
        return None
    return "\n".join(chunk).rstrip()


def _temperature(rng: random.Random, choices: Sequence[float | None]) -> float | None:
    return rng.choice(list(choices))


# Temperatures overlap between classes on purpose: they inform, they do not give away.
_TEMPERATURES: dict[str, tuple[float | None, ...]] = {
    "code": (None, 0.0, 0.0, 0.2, 0.2, 0.7, 1.0),
    "structured": (None, 0.0, 0.0, 0.1, 0.3, 0.7, 1.0),
    "edit": (None, 0.0, 0.3, 0.3, 0.7, 1.0),
    "chat": (None, None, 0.7, 0.7, 1.0, 0.5, 0.2),
    "creative": (None, 0.7, 0.9, 1.0, 1.0, 1.2, 0.5),
}


def _fill_structured(side: _Side, rng: random.Random, template: str) -> str:
    fields = rng.sample(side.lists["fields"], k=min(len(side.lists["fields"]), rng.randint(2, 5)))
    prose = rng.choice(side.prose_documents)
    passages = _passages(prose) or [prose.text[:MAX_PASSAGE_CHARS]]
    terms = _terms(prose.text) or ["item"]
    subject = f"{rng.choice(terms)} in {_project(prose)}"
    record = {f: _fake_value(f, rng, terms) for f in fields}
    return template.format(
        keys=", ".join(f'"{f}"' for f in fields),
        fields=", ".join(fields),
        subject=subject,
        record="\n".join(f"{k}: {v}" for k, v in record.items()),
        schema=json.dumps(
            {"type": "object", "properties": {f: {"type": _json_type(f)} for f in fields}}
        ),
        passage=_excerpt(rng.choice(passages), rng),
        template=json.dumps(dict.fromkeys(fields), indent=2),
        n=rng.randint(2, 8),
        extra=rng.choice(terms),
        json=json.dumps(record, indent=rng.choice([None, 2])),
        csv="\n".join(
            [",".join(fields)]
            + [
                ",".join(str(_fake_value(f, rng, terms)) for f in fields)
                for _ in range(rng.randint(2, 5))
            ]
        ),
        logline=f"{rng.randint(1, 28):02d}/Mar/2026:10:{rng.randint(0, 59):02d}:00 "
        f"{rng.choice(terms)} status={rng.choice([200, 404, 500])} took={rng.randint(1, 900)}ms",
    )


def _json_type(field: str) -> str:
    if field in {"price", "score", "latitude", "longitude"}:
        return "number"
    if field in {"id", "quantity", "year", "priority", "timeout_ms"}:
        return "integer"
    if field == "enabled":
        return "boolean"
    if field == "tags":
        return "array"
    return "string"


def _fake_value(field: str, rng: random.Random, terms: Sequence[str]) -> object:
    kind = _json_type(field)
    if kind == "number":
        return round(rng.uniform(0, 500), 2)
    if kind == "integer":
        return rng.randint(1, 5000)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return rng.sample(list(terms), k=min(len(terms), 2))
    return rng.choice(list(terms))


def _make_code(side: _Side, rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.7:
        for _ in range(20):
            document = rng.choice(side.code_documents)
            chunk = _code_chunk(document, rng)
            if chunk is None:
                continue
            instruction = rng.choice(side.lists["code_instructions"]).format(
                lang=document.language.capitalize()
            )
            prompt = f"{instruction}\n\n{chunk}" if instruction else chunk
            if rng.random() < 0.3:
                prompt = f"{chunk}\n\n{instruction}" if instruction else chunk
            return prompt, document.name
    template = rng.choice(side.lists["code_requests"])
    prompt = template.format(
        lang=rng.choice(CODE_LANGUAGES), task=rng.choice(side.lists["code_tasks"])
    )
    return prompt, _template_group("code-request", CODE_REQUESTS, template)


def _make_edit(side: _Side, rng: random.Random) -> tuple[str, str]:
    for _ in range(50):
        document = rng.choice(side.prose_documents)
        passages = _passages(document)
        if not passages:
            continue
        terms = _terms(document.text) or ["this"]
        template = rng.choice(side.lists["edit"])
        prompt = template.format(
            passage=_excerpt(rng.choice(passages), rng),
            passage2=rng.choice(passages),
            term=rng.choice(terms),
            term2=rng.choice(terms),
        )
        return prompt, document.name
    raise ValueError("no prose document has a usable paragraph")


def _tech_topic(side: _Side, rng: random.Random) -> str:
    document = rng.choice(side.prose_documents)
    project = _project(document)
    terms = _terms(document.text)
    return f"{rng.choice(terms)} in {project}" if terms and rng.random() < 0.5 else project


def _make_chat(side: _Side, rng: random.Random) -> tuple[str, str]:
    def topic() -> str:
        if rng.random() < 0.6:
            return rng.choice(side.lists["topics"])
        return _tech_topic(side, rng)

    template = rng.choice(side.lists["chat"])
    prompt = template.format(
        topic=topic(), topic2=topic(), activity=rng.choice(side.lists["activities"])
    )
    if rng.random() < 0.3:
        # A multi-turn conversation flattened the way prompt_text joins messages.
        earlier = rng.choice(side.lists["chat"]).format(
            topic=topic(), topic2=topic(), activity=rng.choice(side.lists["activities"])
        )
        prompt = "\n\n".join([earlier, rng.choice(side.lists["turns"]), prompt])
    prompt = _wrap(prompt, side, rng, "chat")
    return prompt, _template_group("chat", CHAT_TEMPLATES, template)


def _wrap(prompt: str, side: _Side, rng: random.Random, prefix: str) -> str:
    """Surround a prompt with an optional opener and closer from the side's lists."""
    opener = rng.choice(side.lists[f"{prefix}_openers"])
    closer = rng.choice(side.lists[f"{prefix}_closers"])
    return " ".join(part for part in (opener, prompt, closer) if part)


def _make_creative(side: _Side, rng: random.Random) -> tuple[str, str]:
    def subject() -> str:
        if rng.random() < 0.5:
            return rng.choice(side.lists["topics"])
        document = rng.choice(side.prose_documents)
        terms = _terms(document.text)
        return f"a {rng.choice(terms)}" if terms else "the sea"

    template = rng.choice(side.lists["creative"])
    prompt = template.format(
        subject=subject(),
        character=rng.choice(side.lists["characters"]),
        event=rng.choice(side.lists["events"]),
        genre=rng.choice(GENRES),
        scenario=rng.choice(side.lists["scenarios"]),
        opening=rng.choice(side.lists["openings"]),
    )
    return _wrap(prompt, side, rng, "creative"), _template_group(
        "creative", CREATIVE_TEMPLATES, template
    )


def _make_structured(side: _Side, rng: random.Random) -> tuple[str, str]:
    template = rng.choice(side.lists["structured"])
    return _fill_structured(side, rng, template), _template_group(
        "structured", STRUCTURED_TEMPLATES, template
    )


_MAKERS: dict[str, Callable[[_Side, random.Random], tuple[str, str]]] = {
    "code": _make_code,
    "structured": _make_structured,
    "edit": _make_edit,
    "chat": _make_chat,
    "creative": _make_creative,
}

DEFAULT_CLASSES: tuple[str, ...] = tuple(_MAKERS)
"""The default model's classes: code; structured output (JSON); edit / RAG (rewrite or
answer from a given text); chat; creative writing."""

_LISTS: dict[str, Sequence[str]] = {
    "code_instructions": CODE_INSTRUCTIONS,
    "code_tasks": CODE_TASKS,
    "code_requests": CODE_REQUESTS,
    "structured": STRUCTURED_TEMPLATES,
    "edit": EDIT_TEMPLATES,
    "chat": CHAT_TEMPLATES,
    "turns": CHAT_TURNS,
    "chat_openers": CHAT_OPENERS,
    "chat_closers": CHAT_CLOSERS,
    "creative_openers": CREATIVE_OPENERS,
    "creative_closers": CREATIVE_CLOSERS,
    "topics": EVERYDAY_TOPICS,
    "activities": ACTIVITIES,
    "creative": CREATIVE_TEMPLATES,
    "characters": CHARACTERS,
    "events": EVENTS,
    "scenarios": SCENARIOS,
    "openings": OPENINGS,
    "fields": FIELD_NAMES,
}


def build_dataset(
    documents: Sequence[SourceDocument], seed: int = 0, rows_per_class: int = ROWS_PER_CLASS
) -> list[DatasetRow]:
    """Labelled rows for the default classes, train and held-out, from ``documents``.

    Deterministic: the same documents (in any order) and seed give the same rows.
    Raises ValueError when there are too few code or prose documents to split.
    """
    rng = random.Random(seed)
    ordered = sorted(documents, key=lambda d: d.name)
    code = [d for d in ordered if d.kind == "code"]
    prose = [d for d in ordered if d.kind == "prose" and _passages(d)]
    for kind, docs in (("code", code), ("prose", prose)):
        if len({document_origin(d.name) for d in docs}) < 2:
            raise ValueError(f"need {kind} documents from at least two origins to split")
    code_train, code_test = _split_by_origin(code, rng)
    prose_train, prose_test = _split_by_origin(prose, rng)
    train_lists: dict[str, list[str]] = {}
    test_lists: dict[str, list[str]] = {}
    for key, items in _LISTS.items():
        train_lists[key], test_lists[key] = _split_list(items, rng)
    sides = (
        _Side("train", code_train, prose_train, train_lists),
        _Side("test", code_test, prose_test, test_lists),
    )
    n_test = round(rows_per_class * HELD_OUT_SHARE)
    rows: list[DatasetRow] = []
    for workload_class, make in _MAKERS.items():
        for side, count in ((sides[0], rows_per_class - n_test), (sides[1], n_test)):
            for _ in range(count):
                prompt, group = make(side, rng)
                temperature = _temperature(rng, _TEMPERATURES[workload_class])
                rows.append(DatasetRow(prompt, workload_class, temperature, group, side.split))
    return rows
