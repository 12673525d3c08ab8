// Pins the protoc plugins that buf.gen.yaml runs (`go -C clients/go/tools tool ...`), kept in
// their own module so users of the client never inherit them.
module github.com/gengate/gengate/clients/go/tools

go 1.25.0

tool (
	google.golang.org/grpc/cmd/protoc-gen-go-grpc
	google.golang.org/protobuf/cmd/protoc-gen-go
)

require (
	google.golang.org/grpc/cmd/protoc-gen-go-grpc v1.6.2 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
)
