"""The messages and service names of JetStream's gRPC protocol (google-jetstream 0.2.2,
`jetstream/core/proto/jetstream.proto`), with protobuf alone.

When google-jetstream is installed its generated `jetstream_pb2` is used. Otherwise the
same file descriptor is built here from the .proto text below, in a private descriptor
pool, so the wire format and the method paths (`/jetstream_proto.Orchestrator/Decode`)
are identical and a JetStream client talks to glmjax-serve unchanged.
"""

from __future__ import annotations

import types

SERVICE = "jetstream_proto.Orchestrator"
DECODE = f"/{SERVICE}/Decode"
HEALTH_CHECK = f"/{SERVICE}/HealthCheck"

# jetstream.proto of 0.2.2 as a FileDescriptorProto in text format.
_DESCRIPTOR = """
name: "jetstream/core/proto/jetstream.proto"
package: "jetstream_proto"
syntax: "proto3"
message_type {
  name: "DecodeRequest"
  field { name: "session_cache" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
  field { name: "priority" number: 3 label: LABEL_OPTIONAL type: TYPE_INT32 }
  field { name: "max_tokens" number: 4 label: LABEL_OPTIONAL type: TYPE_INT32 }
  field { name: "text_content" number: 5 label: LABEL_OPTIONAL type: TYPE_MESSAGE
          type_name: ".jetstream_proto.DecodeRequest.TextContent" oneof_index: 0 }
  field { name: "token_content" number: 6 label: LABEL_OPTIONAL type: TYPE_MESSAGE
          type_name: ".jetstream_proto.DecodeRequest.TokenContent" oneof_index: 0 }
  nested_type { name: "TextContent" field { name: "text" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING } }
  nested_type { name: "TokenContent" field { name: "token_ids" number: 1 label: LABEL_REPEATED type: TYPE_INT32 } }
  oneof_decl { name: "content" }
  reserved_range { start: 2 end: 3 }
}
message_type {
  name: "DecodeResponse"
  field { name: "initial_content" number: 2 label: LABEL_OPTIONAL type: TYPE_MESSAGE
          type_name: ".jetstream_proto.DecodeResponse.InitialContent" oneof_index: 0 }
  field { name: "stream_content" number: 3 label: LABEL_OPTIONAL type: TYPE_MESSAGE
          type_name: ".jetstream_proto.DecodeResponse.StreamContent" oneof_index: 0 }
  nested_type { name: "InitialContent" }
  nested_type {
    name: "StreamContent"
    field { name: "samples" number: 1 label: LABEL_REPEATED type: TYPE_MESSAGE
            type_name: ".jetstream_proto.DecodeResponse.StreamContent.Sample" }
    nested_type {
      name: "Sample"
      field { name: "text" number: 1 label: LABEL_OPTIONAL type: TYPE_STRING }
      field { name: "token_ids" number: 2 label: LABEL_REPEATED type: TYPE_INT32 }
    }
  }
  oneof_decl { name: "content" }
  reserved_range { start: 1 end: 2 }
}
message_type { name: "HealthCheckRequest" }
message_type {
  name: "HealthCheckResponse"
  field { name: "is_live" number: 1 label: LABEL_OPTIONAL type: TYPE_BOOL }
}
service {
  name: "Orchestrator"
  method { name: "Decode" input_type: ".jetstream_proto.DecodeRequest"
           output_type: ".jetstream_proto.DecodeResponse" server_streaming: true }
  method { name: "HealthCheck" input_type: ".jetstream_proto.HealthCheckRequest"
           output_type: ".jetstream_proto.HealthCheckResponse" }
}
"""

_NAMES = ("DecodeRequest", "DecodeResponse", "HealthCheckRequest", "HealthCheckResponse")


def _build() -> types.SimpleNamespace:
    from google.protobuf import (
        descriptor_pb2,
        descriptor_pool,
        message_factory,
        text_format,
    )

    file_proto = text_format.Parse(_DESCRIPTOR, descriptor_pb2.FileDescriptorProto())
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(file_proto.SerializeToString())
    file = pool.FindFileByName(file_proto.name)
    return types.SimpleNamespace(
        **{name: message_factory.GetMessageClass(file.message_types_by_name[name]) for name in _NAMES},
        DESCRIPTOR=file, source="glmjax")


def load() -> types.SimpleNamespace:
    """The four message classes (DecodeRequest, DecodeResponse, HealthCheckRequest,
    HealthCheckResponse) and `source`: "jetstream" or "glmjax"."""
    global _MESSAGES
    if _MESSAGES is None:
        try:
            from jetstream.core.proto import jetstream_pb2
        except ImportError:
            _MESSAGES = _build()
        else:
            _MESSAGES = types.SimpleNamespace(**{n: getattr(jetstream_pb2, n) for n in _NAMES},
                                              DESCRIPTOR=jetstream_pb2.DESCRIPTOR, source="jetstream")
    return _MESSAGES


_MESSAGES: types.SimpleNamespace | None = None
