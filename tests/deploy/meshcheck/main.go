// meshcheck validates deploy/mesh against the projects' own Go types, for tests on a machine
// without envoy, istioctl or a cluster: the Envoy bootstrap against go-control-plane's protos
// (unknown fields rejected, then every protoc-gen-validate rule), Istio resources' specs
// against istio.io/api's protos. Each file is named on the command line; the kind is read from
// the document (an Envoy bootstrap has none).
//
//	meshcheck deploy/mesh/envoy/envoy.yaml deploy/mesh/istio/*.yaml
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/retry/host/previous_hosts/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
	networkingv1 "istio.io/api/networking/v1"
	"sigs.k8s.io/yaml"
)

type validator interface{ ValidateAll() error }

func main() {
	failed := false
	for _, path := range os.Args[1:] {
		if err := checkFile(path); err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", path, err)
			failed = true
		} else {
			fmt.Printf("%s: ok\n", path)
		}
	}
	if failed {
		os.Exit(1)
	}
}

func checkFile(path string) error {
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	for i, doc := range bytes.Split(data, []byte("\n---")) {
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		if err := checkDoc(doc); err != nil {
			return fmt.Errorf("document %d: %w", i, err)
		}
	}
	return nil
}

func checkDoc(doc []byte) error {
	var head struct {
		Kind string          `json:"kind"`
		Spec json.RawMessage `json:"spec"`
	}
	js, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(js, &head); err != nil {
		return err
	}
	var msg proto.Message
	body := js
	switch head.Kind {
	case "":
		msg = &bootstrapv3.Bootstrap{}
	case "DestinationRule":
		msg, body = &networkingv1.DestinationRule{}, head.Spec
	case "VirtualService":
		msg, body = &networkingv1.VirtualService{}, head.Spec
	default:
		return fmt.Errorf("kind %q: not checked by meshcheck", head.Kind)
	}
	if err := (protojson.UnmarshalOptions{}).Unmarshal(body, msg); err != nil {
		return err
	}
	if err := validateDeep(msg.ProtoReflect()); err != nil {
		return err
	}
	if msg, ok := msg.(*bootstrapv3.Bootstrap); ok && len(msg.GetStaticResources().GetClusters()) == 0 {
		return errors.New("no clusters")
	}
	return nil
}

// validateDeep runs every protoc-gen-validate rule, including inside typed_config Anys, which
// ValidateAll does not open.
func validateDeep(m protoreflect.Message) error {
	if a, ok := m.Interface().(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			return err
		}
		return validateDeep(inner.ProtoReflect())
	}
	if v, ok := m.Interface().(validator); ok {
		if err := v.ValidateAll(); err != nil {
			return fmt.Errorf("%s: %w", m.Descriptor().FullName(), err)
		}
	}
	var err error
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap():
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					err = validateDeep(mv.Message())
					return err == nil
				})
			}
		case fd.IsList():
			if fd.Kind() == protoreflect.MessageKind {
				for i := 0; i < v.List().Len() && err == nil; i++ {
					err = validateDeep(v.List().Get(i).Message())
				}
			}
		case fd.Kind() == protoreflect.MessageKind:
			err = validateDeep(v.Message())
		}
		return err == nil
	})
	return err
}
