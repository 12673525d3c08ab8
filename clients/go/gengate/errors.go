package gengate

import (
	"errors"
	"fmt"
	"io"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FieldViolation names a request field that was wrong and why (google.rpc.BadRequest).
type FieldViolation struct {
	Field       string
	Description string
	Reason      string
}

// Error is a failed call or batch item: the gRPC code plus the google.rpc details the server
// attached. errors.As(err, &*gengate.Error) finds it; status.Code(err) works too.
type Error struct {
	Code    codes.Code
	Message string
	// Reason, Domain and Metadata come from google.rpc.ErrorInfo, when present.
	Reason   string
	Domain   string
	Metadata map[string]string
	// FieldViolations come from google.rpc.BadRequest.
	FieldViolations []FieldViolation
	// RetryDelay comes from google.rpc.RetryInfo (0 when absent).
	RetryDelay time.Duration
	status     *status.Status
}

func (e *Error) Error() string {
	msg := fmt.Sprintf("gengate: %s: %s", e.Code, e.Message)
	if e.Reason != "" {
		msg += " (" + e.Reason + ")"
	}
	for _, v := range e.FieldViolations {
		msg += fmt.Sprintf("; %s: %s", v.Field, v.Description)
	}
	return msg
}

// GRPCStatus lets status.FromError and status.Code see the original status.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// Field returns the violation for field, if the server reported one.
func (e *Error) Field(field string) (FieldViolation, bool) {
	for _, v := range e.FieldViolations {
		if v.Field == field {
			return v, true
		}
	}
	return FieldViolation{}, false
}

func isEOF(err error) bool { return errors.Is(err, io.EOF) }

// asError turns a gRPC status error into *Error; other errors pass through, nil stays nil.
// The status is the one the server sent even where gRPC wrapped it: its retry ends with
// "max retries exhausted: failed after N attempts: %w", and status.FromError would make that
// text the message, so Message would differ from the other languages' clients.
func asError(err error) error {
	if err == nil {
		return nil
	}
	var inner interface{ GRPCStatus() *status.Status }
	if errors.As(err, &inner) {
		if st := inner.GRPCStatus(); st != nil {
			return fromStatus(st)
		}
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	return fromStatus(st)
}

func errorFromProto(p *spb.Status) *Error { return fromStatus(status.FromProto(p)) }

func fromStatus(st *status.Status) *Error {
	e := &Error{Code: st.Code(), Message: st.Message(), status: st}
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.ErrorInfo:
			e.Reason, e.Domain, e.Metadata = d.GetReason(), d.GetDomain(), d.GetMetadata()
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				e.FieldViolations = append(e.FieldViolations, FieldViolation{
					Field: v.GetField(), Description: v.GetDescription(), Reason: v.GetReason(),
				})
			}
		case *errdetails.RetryInfo:
			e.RetryDelay = d.GetRetryDelay().AsDuration()
		}
	}
	return e
}
