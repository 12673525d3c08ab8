package gengate_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/gengate/gengate/clients/go/gengate"
)

// refusedCode is the gengate error code of err (fails the test when err is not one).
func refusedCode(t *testing.T, err error) codes.Code {
	t.Helper()
	var gerr *gengate.Error
	if !errors.As(err, &gerr) {
		t.Fatalf("err = %v, want a *gengate.Error", err)
	}
	if gerr.Reason != "FAKE_REFUSED" {
		t.Fatalf("reason %q, want the fake's refusal: %v", gerr.Reason, err)
	}
	return gerr.Code
}

func TestRetryAfterPushbackSucceeds(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	fake.failNext("Generate", fault{code: codes.ResourceExhausted, pushback: "0", calls: 1})
	resp, err := c.Generate(context.Background(), gengate.Prompt("tiny", "again"))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetGenerations()[0].GetText(); got != "echo: again" {
		t.Fatalf("text %q", got)
	}
	if n := fake.attemptsOf("Generate"); n != 2 {
		t.Fatalf("%d attempts, want 2", n)
	}
}

func TestRetryWithoutPushbackBacksOff(t *testing.T) {
	fake, addr := startFake(t, nil)
	// no pushback trailer: gRPC's own backoff (0.2 s initial, jittered) before the retry
	c := dial(t, addr)
	fake.failNext("Generate", fault{code: codes.Unavailable, calls: 1})
	if _, err := c.Generate(context.Background(), gengate.Prompt("tiny", "again")); err != nil {
		t.Fatal(err)
	}
	if n := fake.attemptsOf("Generate"); n != 2 {
		t.Fatalf("%d attempts, want 2", n)
	}
}

func TestRetryGivesUpAfterMaxRetriesWithTheServersError(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	fake.failNext("Generate", fault{code: codes.ResourceExhausted, pushback: "0", calls: 10})
	_, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x"))
	if code := refusedCode(t, err); code != codes.ResourceExhausted {
		t.Fatalf("code %v", code)
	}
	var gerr *gengate.Error
	errors.As(err, &gerr)
	// gRPC wraps the last error in "max retries exhausted: ..."; the message stays the server's
	if gerr.Message != "fake refusal" {
		t.Fatalf("message %q, want the server's", gerr.Message)
	}
	if n := fake.attemptsOf("Generate"); n != gengate.DefaultRetryPolicy.MaxRetries+1 {
		t.Fatalf("%d attempts, want %d", n, gengate.DefaultRetryPolicy.MaxRetries+1)
	}
}

func TestMaxRetriesZeroMakesOneAttempt(t *testing.T) {
	for name, opt := range map[string]gengate.Option{
		"WithMaxRetries": gengate.WithMaxRetries(0),
		"WithRetry":      gengate.WithRetry(gengate.RetryPolicy{MaxRetries: 0}),
	} {
		t.Run(name, func(t *testing.T) {
			fake, addr := startFake(t, nil)
			c := dial(t, addr, opt)
			fake.failNext("Generate", fault{code: codes.Unavailable, pushback: "0", calls: 1})
			if code := refusedCode(t, func() error { _, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x")); return err }()); code != codes.Unavailable {
				t.Fatalf("code %v", code)
			}
			if n := fake.attemptsOf("Generate"); n != 1 {
				t.Fatalf("%d attempts, want 1", n)
			}
		})
	}
}

func TestWithMaxRetriesSetsTheAttempts(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr, gengate.WithMaxRetries(4))
	fake.failNext("Generate", fault{code: codes.Unavailable, pushback: "0", calls: 10})
	_, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x"))
	refusedCode(t, err)
	if n := fake.attemptsOf("Generate"); n != 5 {
		t.Fatalf("%d attempts, want 5", n)
	}
}

func TestNegativePushbackIsNotRetried(t *testing.T) {
	for _, pushback := range []string{"-1", "soon"} {
		t.Run(pushback, func(t *testing.T) {
			fake, addr := startFake(t, nil)
			c := dial(t, addr)
			fake.failNext("Generate", fault{code: codes.ResourceExhausted, pushback: pushback, calls: 1})
			_, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x"))
			if code := refusedCode(t, err); code != codes.ResourceExhausted {
				t.Fatalf("code %v", code)
			}
			if n := fake.attemptsOf("Generate"); n != 1 {
				t.Fatalf("%d attempts, want 1", n)
			}
		})
	}
}

func TestOtherCodesAreNotRetried(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	fake.failNext("Generate", fault{code: codes.Internal, pushback: "0", calls: 1})
	_, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x"))
	if code := refusedCode(t, err); code != codes.Internal {
		t.Fatalf("code %v", code)
	}
	if n := fake.attemptsOf("Generate"); n != 1 {
		t.Fatalf("%d attempts, want 1", n)
	}
}

func TestRetryableCodesArePolicy(t *testing.T) {
	fake, addr := startFake(t, nil)
	policy := gengate.DefaultRetryPolicy
	policy.RetryableCodes = []codes.Code{codes.Internal}
	c := dial(t, addr, gengate.WithRetry(policy))
	fake.failNext("Generate", fault{code: codes.Internal, pushback: "0", calls: 1})
	if _, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x")); err != nil {
		t.Fatal(err)
	}
	fake.failNext("Generate", fault{code: codes.Unavailable, pushback: "0", calls: 1})
	if _, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x")); refusedCode(t, err) != codes.Unavailable {
		t.Fatal(err)
	}
	if n := fake.attemptsOf("Generate"); n != 3 {
		t.Fatalf("%d attempts, want 2 then 1", n)
	}
}

func TestStreamRetriedBeforeItsFirstMessage(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	fake.failNext("GenerateStream", fault{code: codes.Unavailable, pushback: "0", calls: 1})
	frames := 0
	for _, err := range c.GenerateStream(context.Background(), gengate.Prompt("tiny", "a b")) {
		if err != nil {
			t.Fatal(err)
		}
		frames++
	}
	if frames != 4 { // start, 2 deltas, end
		t.Fatalf("%d frames", frames)
	}
	if n := fake.attemptsOf("GenerateStream"); n != 2 {
		t.Fatalf("%d attempts, want 2", n)
	}
}

func TestStreamNotRetriedAfterItsFirstMessage(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	fake.failNext("GenerateStream", fault{code: codes.Unavailable, pushback: "0", calls: 1, afterFirstMessage: true})
	frames := 0
	var streamErr error
	for frame, err := range c.GenerateStream(context.Background(), gengate.Prompt("tiny", "a b")) {
		if err != nil {
			streamErr = err
			break
		}
		if frames == 0 && frame.GetStart() == nil {
			t.Fatalf("first frame %v", frame)
		}
		frames++
	}
	if code := refusedCode(t, streamErr); code != codes.Unavailable || frames != 1 {
		t.Fatalf("code %v after %d frames, want UNAVAILABLE after 1", code, frames)
	}
	if n := fake.attemptsOf("GenerateStream"); n != 1 {
		t.Fatalf("%d attempts, want 1", n)
	}
}

func TestBatchGenerateRetriedBeforeItsFirstItem(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	fake.failNext("BatchGenerate", fault{code: codes.ResourceExhausted, pushback: "0", calls: 1})
	items := 0
	for _, err := range c.BatchGenerate(context.Background(), []*gengate.Request{gengate.Prompt("tiny", "a"), gengate.Prompt("tiny", "b")}) {
		if err != nil {
			t.Fatal(err)
		}
		items++
	}
	if items != 2 || fake.attemptsOf("BatchGenerate") != 2 {
		t.Fatalf("%d items after %d attempts, want 2 after 2", items, fake.attemptsOf("BatchGenerate"))
	}
}

func TestCreateBatchJobIsNotRetried(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	jobs := c.BatchJobs()
	for _, method := range []string{"CreateBatchJob", "UploadBatchJob"} {
		fake.failNext(method, fault{code: codes.Unavailable, pushback: "0", calls: 1})
	}
	_, err := jobs.Create(context.Background(), []*gengate.Request{gengate.Prompt("tiny", "a")})
	if code := refusedCode(t, err); code != codes.Unavailable {
		t.Fatalf("code %v", code)
	}
	if n := fake.attemptsOf("CreateBatchJob"); n != 1 {
		t.Fatalf("CreateBatchJob: %d attempts, want 1", n)
	}
	_, err = jobs.Create(context.Background(), []*gengate.Request{gengate.Prompt("tiny", "a")}, gengate.WithItemDefaults(gengate.Prompt("tiny", "")))
	if code := refusedCode(t, err); code != codes.Unavailable {
		t.Fatalf("code %v", code)
	}
	if n := fake.attemptsOf("UploadBatchJob"); n != 1 {
		t.Fatalf("UploadBatchJob: %d attempts, want 1", n)
	}
}

func TestIdempotentBatchJobCallsAreRetried(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	jobs := c.BatchJobs()
	job, err := jobs.Create(context.Background(), []*gengate.Request{gengate.Prompt("tiny", "a"), gengate.Prompt("tiny", "pending")})
	if err != nil {
		t.Fatal(err)
	}
	for _, method := range []string{"GetBatchJob", "ListBatchJobs", "CancelBatchJob", "StreamBatchJobResults"} {
		fake.failNext(method, fault{code: codes.Unavailable, pushback: "0", calls: 1})
	}
	if _, err := jobs.Get(context.Background(), job.GetId()); err != nil {
		t.Fatal(err)
	}
	for _, err := range jobs.List(context.Background(), 10) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := jobs.Cancel(context.Background(), job.GetId()); err != nil {
		t.Fatal(err)
	}
	for _, err := range jobs.Results(context.Background(), job.GetId(), nil, false) {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, method := range []string{"GetBatchJob", "ListBatchJobs", "CancelBatchJob", "StreamBatchJobResults"} {
		if n := fake.attemptsOf(method); n != 2 {
			t.Errorf("%s: %d attempts, want 2", method, n)
		}
	}
}

func TestRetryStopsAtTheDeadline(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr)
	// a pushback longer than the call's deadline: gRPC's retry waits into DEADLINE_EXCEEDED
	// (the real server sends -1 instead when its delay would pass the caller's deadline)
	fake.failNext("Generate", fault{code: codes.Unavailable, pushback: "60000", calls: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := c.Generate(ctx, gengate.Prompt("tiny", "x"))
	var gerr *gengate.Error
	if !errors.As(err, &gerr) || gerr.Code != codes.DeadlineExceeded {
		t.Fatalf("err = %v, want DEADLINE_EXCEEDED", err)
	}
	if n := fake.attemptsOf("Generate"); n != 1 {
		t.Fatalf("%d attempts, want 1", n)
	}
}

func TestOwnServiceConfigWins(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr, gengate.WithDialOptions(grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`)))
	fake.failNext("Generate", fault{code: codes.Unavailable, pushback: "0", calls: 1})
	_, err := c.Generate(context.Background(), gengate.Prompt("tiny", "x"))
	if code := refusedCode(t, err); code != codes.Unavailable {
		t.Fatalf("code %v", code)
	}
	if n := fake.attemptsOf("Generate"); n != 1 {
		t.Fatalf("%d attempts, want 1: the caller's service config has no retry policy", n)
	}
}

func TestRetryPolicyIsChecked(t *testing.T) {
	for name, opt := range map[string]gengate.Option{
		"too many":         gengate.WithMaxRetries(gengate.MaxRetriesLimit + 1),
		"negative":         gengate.WithMaxRetries(-1),
		"negative backoff": gengate.WithRetry(gengate.RetryPolicy{MaxRetries: 1, InitialBackoff: -time.Second}),
		"OK retryable":     gengate.WithRetry(gengate.RetryPolicy{MaxRetries: 1, RetryableCodes: []codes.Code{codes.OK}}),
	} {
		if c, err := gengate.Dial("localhost:1", gengate.WithInsecure(), opt); err == nil {
			_ = c.Close()
			t.Errorf("%s: Dial accepted the policy", name)
		}
	}
}
