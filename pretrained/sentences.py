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

#: Calibration text for ``attnx export --int8`` (per-channel activation ranges for smoothing): real
#: sentences of every length, none of them in :data:`SENTENCES`, so the check measures held-out text.
CALIBRATION: tuple[str, ...] = (
    "Yes.",
    "Thanks a lot!",
    "No way.",
    "Good morning, everyone.",
    "Could you pass me the salt, please?",
    "The dog chased the ball across the yard.",
    "Two women are walking along the beach at sunset.",
    "I would like to book a table for four at eight o'clock tonight.",
    "The museum will be closed on Monday for maintenance of its heating system.",
    "Heavy rain caused flooding in several low-lying neighbourhoods, and the city opened emergency shelters.",
    "Vaccines train the immune system to recognise a pathogen without causing the disease itself.",
    "The startup raised forty million dollars to expand its battery recycling plants across Europe.",
    "He practised the violin every evening, hoping to pass the conservatory audition in the spring.",
    "Neural networks learn representations by adjusting millions of weights to reduce a loss on training "
    "examples, and regularisation keeps them from memorising noise.",
    "The recipe calls for two cups of flour, a pinch of salt, three eggs and a generous spoon of butter, "
    "mixed slowly until the dough no longer sticks to the bowl.",
    "Astronomers detected water vapour in the atmosphere of a distant exoplanet, raising new questions "
    "about how common habitable worlds might be. Follow-up observations with larger telescopes are "
    "planned for next year, when the planet passes in front of its star again and its light can be "
    "split into a spectrum fine enough to tell clouds from haze.",
    "Why?",
    "See you tomorrow.",
)


#: Who does what, said two ways: :func:`paraphrase_pairs` crosses them into (anchor, positive) pairs.
_SUBJECTS = (("A man", "A guy"), ("A woman", "A lady"), ("A child", "A young kid"), ("An old man", "An elderly man"),
             ("Two students", "A pair of students"), ("The chef", "The cook"), ("A teenager", "A teen"),
             ("My neighbour", "The person next door"), ("A tourist", "A visitor"), ("The teacher", "Our instructor"),
             ("A little girl", "A small girl"), ("The farmer", "The farm worker"))
_ACTIONS = (("is playing a guitar", "plays the guitar"), ("is riding a horse", "rides a horse"),
            ("is cooking pasta in the kitchen", "makes pasta at the stove"),
            ("is reading a newspaper", "reads the daily paper"), ("is swimming in the lake", "swims in a lake"),
            ("is painting a fence", "paints the fence"), ("is feeding the ducks", "gives food to the ducks"),
            ("is climbing a mountain", "climbs up a mountain"), ("is waiting for the train", "waits at the station"),
            ("is fixing a bicycle", "repairs a bike"), ("is writing a letter", "writes a letter by hand"),
            ("is planting tomatoes", "puts tomato plants in the soil"), ("is dancing at a wedding", "dances at a wedding"),
            ("is walking a dog in the park", "takes the dog for a walk in the park"),
            ("is slicing bread", "cuts the bread into slices"), ("is drinking coffee", "sips a cup of coffee"),
            ("is buying vegetables at the market", "shops for vegetables at the market"),
            ("is sleeping on the sofa", "naps on the couch"), ("is watching the stars", "looks at the night sky"),
            ("is carrying a heavy box", "lifts a big heavy box"), ("is singing in a choir", "sings with a choir"),
            ("is washing the car", "cleans the car with water"), ("is knitting a scarf", "knits a warm scarf"),
            ("is taking a photograph", "snaps a picture"), ("is building a sandcastle", "makes a castle of sand"))


def paraphrase_pairs() -> list[tuple[str, str]]:
    """300 built-in (sentence, paraphrase) pairs for contrastive fine-tuning examples and tests."""
    return [(f"{s1} {a1}.", f"{s2} {a2}.") for s1, s2 in _SUBJECTS for a1, a2 in _ACTIONS]
