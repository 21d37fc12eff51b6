"""The runtime core, with no network in it: sessions and their backends, batch/sequence axes, the dynamic
batcher and its pacing, tokenising (``text``), sentence pooling, embedded text use (``encode``), and text
generation (``decoding``, ``sampling``, ``generate``, ``detokenize``, ``scheduler``, ``chat``)."""
