"""What every served API shares on the wire: the error taxonomy and its status tables (``errors``), the one
request envelope (``envelope``), limits, body budgets and the worker policy (``limits``), the HTTP app and
gRPC front end, connection bounds (``http_guard``), the API key (``auth``) and the metrics."""
