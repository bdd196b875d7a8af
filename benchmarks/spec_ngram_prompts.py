"""Copy-heavy chat prompts for the n-gram speculation benchmarks (ours and the llama.cpp peer):
rewrite or summarise a given passage, answer with quotes from a provided document, edit given text.
The passages were written for this benchmark."""

from __future__ import annotations

PASSAGES = [
    "The lighthouse on the northern cape was built in 1871 from granite quarried on the island itself. "
    "Its keepers lived in two stone cottages at the foot of the tower and kept the lamp burning through "
    "every storm of the winter. In 1923 the oil lamp was replaced by an electric light, and in 1968 the "
    "last keeper left when the light was made automatic. Today the cottages house a small museum that "
    "tells the story of the keepers and of the ships that were wrecked on the reef before the tower was lit.",
    "To make bread at home you need flour, water, salt and yeast. Mix the flour and the salt in a large "
    "bowl, dissolve the yeast in warm water, and pour the water into the flour. Knead the dough for ten "
    "minutes until it is smooth and elastic, then cover it and let it rise for one hour in a warm place. "
    "Shape the dough into a loaf, let it rise again for thirty minutes, and bake it for forty minutes in "
    "a hot oven until the crust is golden brown and the loaf sounds hollow when you tap it.",
    "The committee met on Tuesday to review the budget for the coming year. The treasurer reported that "
    "income from membership fees had risen by eight percent, while the cost of renting the hall had "
    "doubled. After a long discussion the committee agreed to keep the fees unchanged, to look for a "
    "cheaper hall before the end of March, and to ask the members to vote on the new plan at the annual "
    "meeting in April. The chair thanked the treasurer for her clear and careful report.",
    "Honey bees live in colonies of up to sixty thousand insects. Each colony has one queen, who lays all "
    "of the eggs, a few hundred male drones, and thousands of female workers. The workers build the comb "
    "from wax, collect nectar and pollen from flowers, feed the young, and guard the entrance of the hive. "
    "When a worker finds a good patch of flowers, she returns to the hive and performs a dance that tells "
    "the other workers the direction and the distance of the food.",
]

CODE = '''def average(values):
    x = 0
    for v in values:
        x = x + v
    if len(values) == 0:
        return 0
    return x / len(values)
'''

QUESTIONS = [
    "When was the electric light installed, and when did the last keeper leave?",
    "How long should the dough be kneaded, and how long should the loaf bake?",
    "What did the committee decide about the membership fees and the hall?",
    "What do the worker bees do?",
]


def chat_messages() -> list[str]:
    """User messages, one per benchmark request (before the chat template)."""
    out = []
    for i, passage in enumerate(PASSAGES):
        out.append(f"Rewrite the following passage, keeping its sentences where you can:\n\n{passage}")
        out.append(f"Answer the question with exact quotes from the document.\n\nDocument:\n{passage}\n\n"
                   f"Question: {QUESTIONS[i]}")
        out.append(f"Repeat the following text exactly, word for word:\n\n{passage}")
        out.append(f"Summarise this passage in a few sentences, quoting its key sentences word for word:\n\n{passage}")
    out.append(f"Rename the variable x to total in this Python function and return the whole function:\n\n{CODE}")
    out.append(f"Add a docstring to this Python function and return the whole function:\n\n{CODE}")
    return out


WARMUP_MESSAGE = "Write two sentences about the sea."  # other than every timed prompt (no cache hit)
