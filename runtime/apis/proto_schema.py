"""A ``.proto`` file (proto3: messages, enums, services) as protobuf descriptors, without a compiler.

``proto-schema-parser`` (pure Python) reads the file; this module turns its syntax tree into the
``FileDescriptorProto`` protoc would write (the test compares the two field by field), so serving needs
no protoc (grpcio-tools) at run time. What TEI's interface uses is covered: scalar, message and enum
fields, ``repeated``, proto3 ``optional`` (its synthetic one-of, as protoc makes it), streaming methods and
the ``idempotency_level`` method option. Anything else is refused by name, not guessed.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pb2

_F = descriptor_pb2.FieldDescriptorProto
SCALARS = {"double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT, "int64": _F.TYPE_INT64, "uint64": _F.TYPE_UINT64,
           "int32": _F.TYPE_INT32, "fixed64": _F.TYPE_FIXED64, "fixed32": _F.TYPE_FIXED32, "bool": _F.TYPE_BOOL,
           "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "uint32": _F.TYPE_UINT32,
           "sfixed32": _F.TYPE_SFIXED32, "sfixed64": _F.TYPE_SFIXED64, "sint32": _F.TYPE_SINT32,
           "sint64": _F.TYPE_SINT64}


class ProtoError(ValueError):
    """A ``.proto`` construct this reader does not translate."""


def file_descriptor(path: Path) -> descriptor_pb2.FileDescriptorProto:
    """``path`` (a proto3 file without imports) as protoc's ``FileDescriptorProto``."""
    from proto_schema_parser import ast
    from proto_schema_parser.parser import Parser

    tree = Parser().parse(path.read_text(encoding="utf-8"))
    out = descriptor_pb2.FileDescriptorProto(name=path.name, syntax="proto3")
    elements = [e for e in tree.file_elements if not isinstance(e, ast.Comment)]
    out.package = next((e.name for e in elements if isinstance(e, ast.Package)), "")
    enums = {e.name for e in elements if isinstance(e, ast.Enum)}
    for element in elements:
        if isinstance(element, ast.Message):
            _message(out.message_type.add(), element, out.package, enums)
        elif isinstance(element, ast.Enum):
            _enum(out.enum_type.add(), element)
        elif isinstance(element, ast.Service):
            _service(out.service.add(), element, out.package)
        elif not isinstance(element, (ast.Package, ast.Option)):
            raise ProtoError(f"{path.name}: {type(element).__name__} is not supported here")
    return out


def _message(out, message, package: str, enums: set[str]) -> None:
    from proto_schema_parser import ast

    out.name = message.name
    for element in message.elements:
        if isinstance(element, ast.Comment):
            continue
        if not isinstance(element, ast.Field) or element.options:
            raise ProtoError(f"message {message.name}: {type(element).__name__} {getattr(element, 'name', '')} "
                             "is not supported here")
        field = out.field.add(name=element.name, number=element.number, json_name=_json_name(element.name))
        cardinality = element.cardinality.value if element.cardinality else None
        field.label = _F.LABEL_REPEATED if cardinality == "REPEATED" else _F.LABEL_OPTIONAL
        if element.type in SCALARS:
            field.type = SCALARS[element.type]
        else:
            field.type = _F.TYPE_ENUM if element.type in enums else _F.TYPE_MESSAGE
            field.type_name = f".{package}.{element.type}" if package else f".{element.type}"
        if cardinality == "OPTIONAL":  # proto3 optional: a synthetic one-of of its own, after the real ones
            field.proto3_optional = True
            field.oneof_index = len(out.oneof_decl)
            out.oneof_decl.add(name=f"_{element.name}")


def _enum(out, enum) -> None:
    from proto_schema_parser import ast

    out.name = enum.name
    for element in enum.elements:
        if isinstance(element, ast.EnumValue) and not element.options:
            out.value.add(name=element.name, number=element.number)
        elif not isinstance(element, ast.Comment):
            raise ProtoError(f"enum {enum.name}: {type(element).__name__} is not supported here")


def _service(out, service, package: str) -> None:
    from proto_schema_parser import ast

    out.name = service.name
    prefix = f".{package}." if package else "."
    for element in service.elements:
        if isinstance(element, ast.Comment):
            continue
        if not isinstance(element, ast.Method):
            raise ProtoError(f"service {service.name}: {type(element).__name__} is not supported here")
        method = out.method.add(name=element.name, input_type=prefix + element.input_type.type,
                                output_type=prefix + element.output_type.type)
        if element.input_type.stream:
            method.client_streaming = True
        if element.output_type.stream:
            method.server_streaming = True
        for option in element.elements:
            if isinstance(option, ast.Option) and option.name == "idempotency_level" and \
                    isinstance(option.value, ast.Identifier):  # an enum value's name; anything else: refused below
                method.options.idempotency_level = descriptor_pb2.MethodOptions.IdempotencyLevel.Value(
                    option.value.name)
            elif not isinstance(option, ast.Comment):
                raise ProtoError(f"method {element.name}: option {getattr(option, 'name', option)} is not supported")


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)
