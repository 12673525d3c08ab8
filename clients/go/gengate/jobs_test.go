package gengate_test

import (
	"context"
	"errors"
	"iter"
	"slices"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
	"github.com/gengate/gengate/clients/go/gengate"
)

// collect reads a Results stream to its end.
func collect(t *testing.T, seq iter.Seq2[*gengate.JobResult, error]) []*gengate.JobResult {
	t.Helper()
	var out []*gengate.JobResult
	for item, err := range seq {
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, item)
	}
	return out
}

func indexes(items []*gengate.JobResult) []uint64 {
	var out []uint64
	for _, item := range items {
		out = append(out, item.Index)
	}
	return out
}

func jobRequests() []*gengate.Request {
	bad := gengate.Prompt("tiny", "four")
	bad.StructuredOutput = gengate.Regex("(ab")
	return []*gengate.Request{gengate.Prompt("tiny", "one"), gengate.Prompt("nope", "two"), gengate.Prompt("tiny", "three"), bad}
}

func TestBatchJobResultsComeInIndexOrderWithItemErrors(t *testing.T) {
	fake, addr := startFake(t, nil)
	c := dial(t, addr, gengate.WithBearerToken("s3cret"))
	ctx := context.Background()
	job, err := c.BatchJobs().Create(ctx, jobRequests(),
		gengate.WithDisplayName("nightly"), gengate.WithIdempotencyKey("k1"), gengate.WithPriority(3),
		gengate.WithMaxConcurrency(2), gengate.WithOffline(), gengate.WithCallMetadata("x-call", "1"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(job.GetId(), "job-") || job.GetTotal() != 4 || job.GetDisplayName() != "nightly" {
		t.Fatalf("job = %v", job)
	}
	sent := fake.jobs.seen().create
	if fake.jobs.callsOf("CreateBatchJob") != 1 || len(sent.GetRequests()) != 4 || sent.GetIdempotencyKey() != "k1" ||
		sent.GetOptions().GetPriority() != 3 || sent.GetOptions().GetMaxConcurrency() != 2 || !sent.GetOptions().GetOffline() {
		t.Fatalf("create sent %v", sent)
	}
	if got := fake.jobs.seen().metadata.Get("x-call"); len(got) != 1 {
		t.Fatalf("per-call metadata missing: %v", fake.jobs.seen().metadata)
	}
	if got := fake.jobs.seen().metadata.Get("authorization"); len(got) != 1 || got[0] != "Bearer s3cret" {
		t.Fatalf("authorization = %v", got)
	}

	items := collect(t, c.BatchJobs().Results(ctx, job.GetId(), nil, false))
	if !slices.Equal(indexes(items), []uint64{0, 1, 2, 3}) {
		t.Fatalf("indexes %v", indexes(items))
	}
	if fake.jobs.seen().results.AfterIndex != nil || fake.jobs.seen().results.GetFollow() {
		t.Fatalf("results request %v: after_index must be unset", fake.jobs.seen().results)
	}
	if items[0].Err != nil || items[0].Response.GetGenerations()[0].GetText() != "echo: one" || items[2].Err != nil {
		t.Fatalf("good items %+v %+v", items[0], items[2])
	}
	var asErr *gengate.Error
	if items[1].Err == nil || items[1].Response != nil || !errors.As(error(items[1].Err), &asErr) || asErr.Code != codes.NotFound ||
		asErr.Reason != "MODEL_NOT_FOUND" || status.Code(items[1].Err) != codes.NotFound {
		t.Fatalf("bad model item %+v", items[1])
	}
	if v, ok := items[3].Err.Field("structured_output.regex.pattern"); !ok || items[3].Err.Code != codes.InvalidArgument || v.Description != "unbalanced parenthesis" {
		t.Fatalf("bad regex item %+v", items[3].Err)
	}

	got, err := c.BatchJobs().Get(ctx, job.GetId())
	if err != nil || got.GetState() != gengatev1.BatchJobState_BATCH_JOB_STATE_SUCCEEDED || got.GetDone() != 4 || got.GetFailed() != 2 {
		t.Fatalf("get = %v, %v", got, err)
	}
}

func TestBatchJobResultsResumeAfterAnIndex(t *testing.T) {
	fake, addr := startFake(t, nil)
	jobs := dial(t, addr).BatchJobs()
	ctx := context.Background()
	job, err := jobs.Create(ctx, jobRequests())
	if err != nil {
		t.Fatal(err)
	}
	items := collect(t, jobs.Results(ctx, job.GetId(), gengate.Ptr[uint64](1), false))
	if !slices.Equal(indexes(items), []uint64{2, 3}) || items[0].Response.GetGenerations()[0].GetText() != "echo: three" {
		t.Fatalf("resumed at %v", indexes(items))
	}
	if fake.jobs.seen().results.AfterIndex == nil || fake.jobs.seen().results.GetAfterIndex() != 1 {
		t.Fatalf("results request %v", fake.jobs.seen().results)
	}
	if items := collect(t, jobs.Results(ctx, job.GetId(), gengate.Ptr[uint64](3), false)); len(items) != 0 {
		t.Fatalf("after the last item: %v", indexes(items))
	}
}

func TestBatchJobFollowWaitsForTheCancelledItem(t *testing.T) {
	_, addr := startFake(t, nil)
	jobs := dial(t, addr).BatchJobs()
	ctx := context.Background()
	job, err := jobs.Create(ctx, []*gengate.Request{gengate.Prompt("tiny", "one"), gengate.Prompt("tiny", "pending")})
	if err != nil {
		t.Fatal(err)
	}
	if job.GetState() != gengatev1.BatchJobState_BATCH_JOB_STATE_RUNNING {
		t.Fatalf("state %v", job.GetState())
	}
	// Without follow the stream ends at the first unfinished item.
	if items := collect(t, jobs.Results(ctx, job.GetId(), nil, false)); !slices.Equal(indexes(items), []uint64{0}) {
		t.Fatalf("without follow: %v", indexes(items))
	}
	// With follow it waits for item 1, which the cancel below finishes.
	var items []*gengate.JobResult
	for item, err := range jobs.Results(ctx, job.GetId(), nil, true) {
		if err != nil {
			t.Fatal(err)
		}
		items = append(items, item)
		if item.Index == 0 {
			cancelled, err := jobs.Cancel(ctx, job.GetId())
			if err != nil || cancelled.GetState() != gengatev1.BatchJobState_BATCH_JOB_STATE_CANCELLED {
				t.Fatalf("cancel = %v, %v", cancelled, err)
			}
		}
	}
	if !slices.Equal(indexes(items), []uint64{0, 1}) || items[1].Err == nil ||
		items[1].Err.Code != codes.Canceled || items[1].Err.Reason != "JOB_CANCELLED" {
		t.Fatalf("followed items %v, last %+v", indexes(items), items[len(items)-1])
	}
}

func TestBatchJobErrors(t *testing.T) {
	_, addr := startFake(t, nil)
	jobs := dial(t, addr).BatchJobs()
	ctx := context.Background()
	job, err := jobs.Create(ctx, []*gengate.Request{gengate.Prompt("tiny", "one")})
	if err != nil {
		t.Fatal(err)
	}
	_, err = jobs.Cancel(ctx, job.GetId())
	var gerr *gengate.Error
	if !errors.As(err, &gerr) || gerr.Code != codes.FailedPrecondition || gerr.Reason != "JOB_FINISHED" {
		t.Fatalf("cancel of a finished job: %v", err)
	}
	if _, err := jobs.Cancel(ctx, "job-nope"); !errors.As(err, &gerr) || gerr.Code != codes.NotFound || gerr.Reason != "JOB_NOT_FOUND" {
		t.Fatalf("cancel of an unknown job: %v", err)
	}
	if got, err := jobs.Get(ctx, "job-nope"); got != nil || status.Code(err) != codes.NotFound {
		t.Fatalf("get of an unknown job: %v, %v", got, err)
	}
	var streamErr error
	for item, err := range jobs.Results(ctx, "job-nope", nil, true) {
		if item != nil {
			t.Fatalf("item %+v from an unknown job", item)
		}
		streamErr = err
	}
	if !errors.As(streamErr, &gerr) || gerr.Code != codes.NotFound || gerr.Reason != "JOB_NOT_FOUND" {
		t.Fatalf("results of an unknown job: %v", streamErr)
	}
	if _, err := jobs.Create(ctx, nil); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("an empty job: %v", err)
	}
}

func TestBatchJobListPagesNewestFirst(t *testing.T) {
	fake, addr := startFake(t, nil)
	jobs := dial(t, addr).BatchJobs()
	ctx := context.Background()
	var ids []string
	for range 5 {
		job, err := jobs.Create(ctx, []*gengate.Request{gengate.Prompt("tiny", "x")})
		if err != nil {
			t.Fatal(err)
		}
		ids = append([]string{job.GetId()}, ids...)
	}
	var listed []string
	for job, err := range jobs.List(ctx, 2) {
		if err != nil {
			t.Fatal(err)
		}
		listed = append(listed, job.GetId())
	}
	if !slices.Equal(listed, ids) || fake.jobs.callsOf("ListBatchJobs") != 3 || fake.jobs.seen().list.GetPageSize() != 2 {
		t.Fatalf("listed %v (want %v) in %d pages", listed, ids, fake.jobs.callsOf("ListBatchJobs"))
	}
	// Breaking out fetches no further page.
	for job, err := range jobs.List(ctx, 2) {
		if err != nil {
			t.Fatal(err)
		}
		if job.GetId() == ids[0] {
			break
		}
	}
	if n := fake.jobs.callsOf("ListBatchJobs"); n != 4 {
		t.Fatalf("%d list calls after breaking on the first page, want 4", n)
	}
	for _, err := range jobs.List(ctx, 2, gengate.WithCallToken("t")) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := fake.jobs.seen().metadata.Get("authorization"); len(got) != 1 || got[0] != "Bearer t" {
		t.Fatalf("per-call token on list pages: %v", got)
	}
}

func TestBatchJobUploadsLargeJobs(t *testing.T) {
	fake, addr := startFake(t, nil)
	jobs := dial(t, addr).BatchJobs()
	ctx := context.Background()
	reqs := make([]*gengate.Request, gengate.UploadAbove+1)
	for i := range reqs {
		reqs[i] = gengate.Prompt("tiny", "item")
	}
	reqs[gengate.UploadAbove].GetInput().(*gengatev1.GenerateRequest_Prompt).Prompt = "last"

	if _, err := jobs.Create(ctx, reqs[:gengate.UploadAbove]); err != nil {
		t.Fatal(err)
	}
	if fake.jobs.callsOf("CreateBatchJob") != 1 || fake.jobs.callsOf("UploadBatchJob") != 0 {
		t.Fatalf("%d requests were not sent in one message: %v", gengate.UploadAbove, fake.jobs.callNames())
	}
	job, err := jobs.Create(ctx, reqs, gengate.WithDisplayName("big"), gengate.WithPriority(1))
	if err != nil {
		t.Fatal(err)
	}
	if fake.jobs.callsOf("UploadBatchJob") != 1 || job.GetTotal() != uint64(len(reqs)) {
		t.Fatalf("upload: calls %v, job %v", fake.jobs.callNames(), job)
	}
	if h := fake.jobs.seen().header; h.GetDisplayName() != "big" || h.GetOptions().GetPriority() != 1 || h.GetDefaults() != nil {
		t.Fatalf("header %v", h)
	}
	items := collect(t, jobs.Results(ctx, job.GetId(), gengate.Ptr(uint64(gengate.UploadAbove-1)), false))
	if !slices.Equal(indexes(items), []uint64{gengate.UploadAbove}) || items[0].Response.GetGenerations()[0].GetText() != "echo: last" {
		t.Fatalf("the last uploaded item: %v", items)
	}
}

func TestBatchJobItemDefaultsAndJSONL(t *testing.T) {
	fake, addr := startFake(t, nil)
	jobs := dial(t, addr).BatchJobs()
	ctx := context.Background()
	defaults := gengate.WithItemDefaults(&gengate.Request{Model: "tiny"})

	job, err := jobs.Create(ctx, []*gengate.Request{gengate.Prompt("", "a")}, defaults)
	if err != nil {
		t.Fatal(err)
	}
	if fake.jobs.callsOf("UploadBatchJob") != 1 || fake.jobs.seen().header.GetDefaults().GetModel() != "tiny" {
		t.Fatalf("defaults not uploaded: %v, header %v", fake.jobs.callNames(), fake.jobs.seen().header)
	}
	if items := collect(t, jobs.Results(ctx, job.GetId(), nil, false)); len(items) != 1 || items[0].Err != nil {
		t.Fatalf("defaulted items %+v", items)
	}

	lines := "{\"prompt\": \"a\"}\r\n\n   \n{not json\n{\"prompt\": \"c\"}"
	job, err = jobs.CreateFromJSONL(ctx, strings.NewReader(lines), defaults)
	if err != nil {
		t.Fatal(err)
	}
	items := collect(t, jobs.Results(ctx, job.GetId(), nil, false))
	if job.GetTotal() != 3 || len(items) != 3 || items[0].Err != nil || items[2].Response.GetGenerations()[0].GetText() != "echo: c" {
		t.Fatalf("jsonl job %v items %v", job, items)
	}
	if items[1].Err == nil || items[1].Err.Code != codes.InvalidArgument {
		t.Fatalf("the bad line: %+v", items[1])
	}
	if outcome := <-fake.jobs.uploadEnded; outcome != "stored" { // the first upload
		t.Fatal(outcome)
	}
	if outcome := <-fake.jobs.uploadEnded; outcome != "stored" {
		t.Fatal(outcome)
	}

	// A reader that fails mid-way abandons the upload: its error comes back, the server stores nothing.
	broken := iotest.TimeoutReader(strings.NewReader("{\"prompt\": \"a\"}\n")) // first read succeeds, then ErrTimeout
	if _, err := jobs.CreateFromJSONL(ctx, broken, defaults); !errors.Is(err, iotest.ErrTimeout) {
		t.Fatalf("read error: %v", err)
	}
	select { // the bound only guards against a hang
	case outcome := <-fake.jobs.uploadEnded:
		if outcome != "aborted" {
			t.Fatalf("the abandoned upload was %s", outcome)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server never saw the abandoned upload end")
	}
}
