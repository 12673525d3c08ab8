package gengate

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
)

// RetryPolicy says how a Client retries a failed call, through gRPC's own retry (gRFC A6, the
// service config's retryPolicy): attempt n+1 of a call that failed with a retryable code waits
// the server's pushback (the grpc-retry-pushback-ms trailer, which gengate sends with every
// RESOURCE_EXHAUSTED and UNAVAILABLE: exactly that many milliseconds; -1, which the server sends
// when its RetryInfo delay is past 10 s or the call's deadline, or a value that does not parse:
// no retry, the error comes back at once) or, without one, a random backoff under
// min(InitialBackoff * BackoffMultiplier^(n-1), MaxBackoff). The call's context deadline covers
// all attempts. A stream is retried only until its first response message, never after.
//
// Retried: every GenerationService method; of the BatchJobService, GetBatchJob, ListBatchJobs,
// CancelBatchJob and StreamBatchJobResults. CreateBatchJob and UploadBatchJob are not
// idempotent and are never retried.
//
// Start from DefaultRetryPolicy and change what you need; a zero InitialBackoff, MaxBackoff,
// BackoffMultiplier or RetryableCodes takes DefaultRetryPolicy's value.
type RetryPolicy struct {
	// MaxRetries is how many times a call is retried (attempts: MaxRetries+1); 0 turns retries
	// off. At most MaxRetriesLimit: gRPC caps a call's attempts at 5.
	MaxRetries        int
	InitialBackoff    time.Duration
	MaxBackoff        time.Duration
	BackoffMultiplier float64
	RetryableCodes    []codes.Code
}

// MaxRetriesLimit is the largest RetryPolicy.MaxRetries (gRPC makes at most 5 attempts).
const MaxRetriesLimit = 4

// DefaultRetryPolicy is what a Client retries with unless WithRetry or WithMaxRetries says
// otherwise: 2 retries (3 attempts), backoff 0.2 s doubling up to 5 s, on UNAVAILABLE and
// RESOURCE_EXHAUSTED.
var DefaultRetryPolicy = RetryPolicy{
	MaxRetries:        2,
	InitialBackoff:    200 * time.Millisecond,
	MaxBackoff:        5 * time.Second,
	BackoffMultiplier: 2,
	RetryableCodes:    []codes.Code{codes.Unavailable, codes.ResourceExhausted},
}

// WithRetry sets the client's retry policy (default DefaultRetryPolicy). Dial fails for a
// MaxRetries below 0 or above MaxRetriesLimit, or a negative backoff or multiplier. A service
// config passed in WithDialOptions (grpc.WithDefaultServiceConfig) replaces this one, and
// grpc.WithDisableRetry turns retries off whatever the policy.
func WithRetry(policy RetryPolicy) Option {
	return func(c *dialConfig) {
		policy.RetryableCodes = slices.Clone(policy.RetryableCodes)
		c.retry = policy
	}
}

// WithMaxRetries changes only the retry policy's MaxRetries (0: no retries).
func WithMaxRetries(n int) Option {
	return func(c *dialConfig) { c.retry.MaxRetries = n }
}

// withDefaults fills the zero fields from DefaultRetryPolicy and checks the result.
func (p RetryPolicy) withDefaults() (RetryPolicy, error) {
	if p.MaxRetries < 0 || p.MaxRetries > MaxRetriesLimit {
		return p, fmt.Errorf("gengate: RetryPolicy.MaxRetries %d: want 0 to %d (gRPC makes at most %d attempts)",
			p.MaxRetries, MaxRetriesLimit, MaxRetriesLimit+1)
	}
	if p.InitialBackoff < 0 || p.MaxBackoff < 0 || p.BackoffMultiplier < 0 {
		return p, fmt.Errorf("gengate: RetryPolicy: negative backoff (%v, %v, x%v)",
			p.InitialBackoff, p.MaxBackoff, p.BackoffMultiplier)
	}
	if p.InitialBackoff == 0 {
		p.InitialBackoff = DefaultRetryPolicy.InitialBackoff
	}
	if p.MaxBackoff == 0 {
		p.MaxBackoff = DefaultRetryPolicy.MaxBackoff
	}
	if p.BackoffMultiplier == 0 {
		p.BackoffMultiplier = DefaultRetryPolicy.BackoffMultiplier
	}
	if len(p.RetryableCodes) == 0 {
		p.RetryableCodes = slices.Clone(DefaultRetryPolicy.RetryableCodes)
	}
	for _, code := range p.RetryableCodes {
		if code == codes.OK || codeNames[code] == "" {
			return p, fmt.Errorf("gengate: RetryPolicy: %v is not a retryable status code", code)
		}
	}
	return p, nil
}

// The methods retried: all of the GenerationService; of the BatchJobService only the idempotent
// ones (creating a job twice would make two jobs).
var retriedMethods = []map[string]string{
	{"service": "gengate.v1.GenerationService"},
	{"service": "gengate.v1.BatchJobService", "method": "GetBatchJob"},
	{"service": "gengate.v1.BatchJobService", "method": "ListBatchJobs"},
	{"service": "gengate.v1.BatchJobService", "method": "CancelBatchJob"},
	{"service": "gengate.v1.BatchJobService", "method": "StreamBatchJobResults"},
}

// serviceConfig is the gRPC service config (JSON) carrying the policy; "" when it retries nothing.
func (p RetryPolicy) serviceConfig() string {
	if p.MaxRetries == 0 {
		return ""
	}
	var retryable []string
	for _, code := range p.RetryableCodes {
		retryable = append(retryable, codeNames[code])
	}
	doc := map[string]any{"methodConfig": []any{map[string]any{
		"name": retriedMethods,
		"retryPolicy": map[string]any{
			"maxAttempts":          p.MaxRetries + 1,
			"initialBackoff":       protoDuration(p.InitialBackoff),
			"maxBackoff":           protoDuration(p.MaxBackoff),
			"backoffMultiplier":    p.BackoffMultiplier,
			"retryableStatusCodes": retryable,
		},
	}}}
	out, err := json.Marshal(doc)
	if err != nil {
		panic(err) // only maps, strings and numbers: cannot fail
	}
	return string(out)
}

// protoDuration writes d as the service config's JSON duration ("0.2s", "5s").
func protoDuration(d time.Duration) string {
	secs, nanos := int64(d/time.Second), int64(d%time.Second)
	if nanos == 0 {
		return strconv.FormatInt(secs, 10) + "s"
	}
	return strconv.FormatInt(secs, 10) + "." + strings.TrimRight(fmt.Sprintf("%09d", nanos), "0") + "s"
}

// codeNames are the gRPC spec's code names, as a service config writes them.
var codeNames = map[codes.Code]string{
	codes.Canceled:           "CANCELLED",
	codes.Unknown:            "UNKNOWN",
	codes.InvalidArgument:    "INVALID_ARGUMENT",
	codes.DeadlineExceeded:   "DEADLINE_EXCEEDED",
	codes.NotFound:           "NOT_FOUND",
	codes.AlreadyExists:      "ALREADY_EXISTS",
	codes.PermissionDenied:   "PERMISSION_DENIED",
	codes.ResourceExhausted:  "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION",
	codes.Aborted:            "ABORTED",
	codes.OutOfRange:         "OUT_OF_RANGE",
	codes.Unimplemented:      "UNIMPLEMENTED",
	codes.Internal:           "INTERNAL",
	codes.Unavailable:        "UNAVAILABLE",
	codes.DataLoss:           "DATA_LOSS",
	codes.Unauthenticated:    "UNAUTHENTICATED",
}
