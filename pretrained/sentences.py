"""Built-in real sentences of varied length: what ``attnx check`` and the demo run pretrained models on."""

SENTENCES: tuple[str, ...] = (
    "The cat sat on the mat.",
    "A man is playing a guitar.",
    "Hi!",
    "Transformers process all tokens of a sequence in parallel, relating each one to every other "
    "through attention weights computed from queries and keys.",
    "The quarterly report shows that revenue grew by twelve percent while operating costs stayed flat.",
    "Where is the nearest train station?",
    "She forgot her umbrella at the café, so she walked home in the rain and arrived soaked but laughing.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Quantum computers exploit superposition and entanglement; error correction remains the main obstacle "
    "to running long algorithms, because physical qubits decohere within microseconds and every logical "
    "qubit needs many physical ones. Researchers are therefore exploring surface codes, cat qubits and "
    "topological approaches, each trading hardware complexity against the overhead of syndrome "
    "extraction and decoding in real time.",
    "Ok.",
    "The committee approved the new bridge design after a long debate about its cost and environmental impact.",
    "A child is feeding ducks at the pond while her grandfather reads a newspaper on the bench.",
)

#: A small retrieval set: queries and the corpus they search (the demo's semantic search).
QUERIES: tuple[str, ...] = ("How do plants make energy from sunlight?", "What is a good place to catch a train?",
                            "Who is making music outdoors?")
