"""The Open Inference Protocol's gRPC messages (KServe v2 gRPC, the service
`inference.GRPCInferenceService` that KServe's and Triton's gRPC clients call), built when first
imported: from the open_inference_grpc.proto inside TorchServe's jar (the protocol's own
definition, which TorchServe ships under its Java package), placed in the protocol's `inference`
package, compiled by grpcio-tools into descriptors.

The message classes live in a descriptor pool of their own, not protobuf's default one, where
KServe's and Triton's client packages register the same `inference.*` names: all may share a
process.

    from open_inference import SERVICE, METHODS, pb   # pb.ModelInferRequest, ...; METHODS: name -> (request, response)
"""

import re
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

SERVICE = "inference.GRPCInferenceService"


def _pool():
    import ts
    from google.protobuf import descriptor_pb2, descriptor_pool
    from grpc_tools import protoc

    jar = Path(ts.__file__).parent / "frontend" / "model-server.jar"
    with zipfile.ZipFile(jar) as z:
        proto = z.read("open_inference_grpc.proto").decode()
    proto = re.sub(r"^package [\w.]+;", "package inference;", proto, count=1, flags=re.M)
    with tempfile.TemporaryDirectory(prefix="open-inference-") as tmp:
        source, compiled = Path(tmp) / "grpc_predict_v2.proto", Path(tmp) / "descriptors.pb"
        source.write_text(proto)
        if protoc.main(["protoc", f"-I{tmp}", f"--descriptor_set_out={compiled}", str(source)]) != 0:
            raise RuntimeError(f"grpcio-tools could not compile the Open Inference Protocol from {jar}")
        files = descriptor_pb2.FileDescriptorSet.FromString(compiled.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for file in files.file:
        pool.Add(file)
    return pool


def _messages():
    from google.protobuf import message_factory

    pool = _pool()
    service = pool.FindServiceByName(SERVICE)
    classes = {}
    for method in service.methods:
        for message in (method.input_type, method.output_type):
            classes[message.name] = message_factory.GetMessageClass(message)
    methods = {m.name: (classes[m.input_type.name], classes[m.output_type.name]) for m in service.methods}
    return SimpleNamespace(**classes), methods


pb, METHODS = _messages()
