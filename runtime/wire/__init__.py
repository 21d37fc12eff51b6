"""What every served API shares on the wire: the error taxonomy and its status tables (``errors``), the one
request envelope (``envelope``), limits and the worker policy (``limits``), the byte budget bodies are charged to
as they arrive (``budget``), counts of a raw JSON body before it is parsed (``counts``), the HTTP app and
gRPC front end, connection bounds (``http_guard``), the API key (``auth``) and the metrics."""
