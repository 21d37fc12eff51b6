"""The TEI ``.proto`` read without a compiler (issue 47): :mod:`attnx.runtime.apis.proto_schema` gives exactly the
descriptor protoc (grpcio-tools, a test dependency only) writes, and refuses what it does not translate."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2

from attnx.runtime.apis.proto_schema import ProtoError, file_descriptor
from attnx.runtime.apis.tei_grpc import PROTO


def _protoc(path, tmp_path) -> descriptor_pb2.FileDescriptorProto:
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{path.parent}", f"--descriptor_set_out={out}", path.name]) == 0
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]


def test_the_tei_interface_reads_as_protoc_writes_it(tmp_path):
    mine, theirs = file_descriptor(PROTO), _protoc(PROTO, tmp_path)
    assert len(mine.message_type) > 20 and len(mine.service) == 5
    assert mine == theirs


def test_a_changed_field_shows(tmp_path):
    """The comparison can fail: a field's number changed in a copy differs from protoc's reading of the original."""
    copy = tmp_path / "tei.proto"
    copy.write_text(PROTO.read_text().replace("string model_id = 4;", "string model_id = 14;"))
    assert file_descriptor(copy) != _protoc(PROTO, tmp_path)
    assert file_descriptor(copy) == _protoc(copy, tmp_path)


def test_an_untranslated_construct_is_refused_by_name(tmp_path):
    path = tmp_path / "m.proto"
    path.write_text('syntax = "proto3";\npackage p;\nmessage M {\n  map<string, int32> counts = 1;\n}\n')
    with pytest.raises(ProtoError, match="message M: MapField counts"):
        file_descriptor(path)
