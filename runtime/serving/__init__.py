"""The served models, below the APIs and above the wire: what a served model provides (``model``: the
:class:`~attnx.runtime.serving.model.ServedModel` protocol and the capabilities), the one registry every API looks
models up in and its admission rules (``registry``), the encoder model (``encoder``, with its KServe ``signature``
and Triton ``model_config``) and the encoding service every embedding and scoring API shares (``encoding``), the
text generator model and its requests' glue (``generation``), and what the routes share (``state``)."""
