package gengate_test

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"sync"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// fakeJobs is an in-memory BatchJobService. A job's items are answered when it is created
// (by the fake's Generate rules), except items whose prompt is "pending": they stay
// unfinished, and the job RUNNING, until the job is cancelled.
type fakeJobs struct {
	gengatev1.UnimplementedBatchJobServiceServer
	srv *fakeServer
	mu  sync.Mutex
	// changed is closed (and replaced) whenever a job changes, waking following streams.
	changed chan struct{}
	jobs    []*fakeJob // in creation order
	// calls names each RPC received ("CreateBatchJob", "UploadBatchJob", ...), in order.
	calls []string
	last  jobCalls
	// uploadEnded gets "stored" or "aborted" when an upload ends.
	uploadEnded chan string
}

// jobCalls is what the last calls carried.
type jobCalls struct {
	metadata metadata.MD
	header   *gengatev1.BatchJobHeader
	create   *gengatev1.CreateBatchJobRequest
	list     *gengatev1.ListBatchJobsRequest
	results  *gengatev1.StreamBatchJobResultsRequest
}

// seen returns what the last calls carried.
func (f *fakeJobs) seen() jobCalls {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.last
}

type fakeJob struct {
	job      *gengatev1.BatchJob
	requests []*gengatev1.GenerateRequest
	results  []*gengatev1.StreamBatchJobResultsResponse // nil: not finished
}

func newFakeJobs(srv *fakeServer) *fakeJobs {
	return &fakeJobs{srv: srv, changed: make(chan struct{}), uploadEnded: make(chan string, 16)}
}

func (f *fakeJobs) called(ctx context.Context, name string) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, name)
	f.last.metadata = md
}

func (f *fakeJobs) ended(outcome string) {
	select {
	case f.uploadEnded <- outcome:
	default:
	}
}

func (f *fakeJobs) callNames() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

func (f *fakeJobs) callsOf(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if c == name {
			n++
		}
	}
	return n
}

func jobError(code codes.Code, reason, msg string) error {
	st, _ := status.New(code, msg).WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: "gengate.dev"})
	return st.Err()
}

func finished(state gengatev1.BatchJobState) bool {
	return state == gengatev1.BatchJobState_BATCH_JOB_STATE_SUCCEEDED ||
		state == gengatev1.BatchJobState_BATCH_JOB_STATE_FAILED ||
		state == gengatev1.BatchJobState_BATCH_JOB_STATE_CANCELLED
}

// store makes a job of items (a nil request stands for an item refused with its error).
func (f *fakeJobs) store(header *gengatev1.BatchJobHeader, items []*gengatev1.GenerateRequest, refused map[int]error) *gengatev1.BatchJob {
	f.mu.Lock()
	defer f.mu.Unlock()
	job := &fakeJob{requests: items, job: &gengatev1.BatchJob{
		Id:             fmt.Sprintf("job-%024x", len(f.jobs)+1),
		DisplayName:    header.GetDisplayName(),
		IdempotencyKey: header.GetIdempotencyKey(),
		Options:        header.GetOptions(),
		Total:          uint64(len(items)),
		State:          gengatev1.BatchJobState_BATCH_JOB_STATE_SUCCEEDED,
	}}
	for i, req := range items {
		out := &gengatev1.StreamBatchJobResultsResponse{Index: uint64(i)}
		err := refused[i]
		if err == nil && req.GetPrompt() == "pending" {
			job.results = append(job.results, nil)
			job.job.State = gengatev1.BatchJobState_BATCH_JOB_STATE_RUNNING
			continue
		}
		if err == nil {
			err = check(req)
		}
		if err != nil {
			out.Result = &gengatev1.StreamBatchJobResultsResponse_Error{Error: status.Convert(err).Proto()}
			job.job.Failed++
		} else {
			out.Result = &gengatev1.StreamBatchJobResultsResponse_Response{Response: f.srv.answer(req)}
		}
		job.results = append(job.results, out)
		job.job.Done++
	}
	f.jobs = append(f.jobs, job)
	f.notifyLocked()
	return proto.Clone(job.job).(*gengatev1.BatchJob)
}

func (f *fakeJobs) notifyLocked() {
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakeJobs) findLocked(id string) (*fakeJob, error) {
	for _, j := range f.jobs {
		if j.job.GetId() == id {
			return j, nil
		}
	}
	return nil, jobError(codes.NotFound, "JOB_NOT_FOUND", "no batch job "+strconv.Quote(id))
}

func (f *fakeJobs) CreateBatchJob(ctx context.Context, req *gengatev1.CreateBatchJobRequest) (*gengatev1.CreateBatchJobResponse, error) {
	f.called(ctx, "CreateBatchJob")
	f.mu.Lock()
	f.last.create = req
	f.mu.Unlock()
	if len(req.GetRequests()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "requests must contain at least one request")
	}
	header := &gengatev1.BatchJobHeader{DisplayName: req.GetDisplayName(), IdempotencyKey: req.GetIdempotencyKey(), Options: req.GetOptions()}
	return &gengatev1.CreateBatchJobResponse{Job: f.store(header, req.GetRequests(), nil)}, nil
}

func (f *fakeJobs) UploadBatchJob(stream grpc.ClientStreamingServer[gengatev1.UploadBatchJobRequest, gengatev1.UploadBatchJobResponse]) error {
	f.called(stream.Context(), "UploadBatchJob")
	first, err := stream.Recv()
	if err != nil {
		f.ended("aborted")
		return err
	}
	header := first.GetHeader()
	if header == nil {
		return status.Error(codes.InvalidArgument, "the first message of an upload must be the header")
	}
	f.mu.Lock()
	f.last.header = header
	f.mu.Unlock()
	var items []*gengatev1.GenerateRequest
	refused := map[int]error{}
	for {
		msg, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil { // the caller went away before the end: no job
			f.ended("aborted")
			return err
		}
		var item *gengatev1.GenerateRequest
		switch part := msg.GetPart().(type) {
		case *gengatev1.UploadBatchJobRequest_Request:
			item = part.Request
		case *gengatev1.UploadBatchJobRequest_JsonLine:
			item = &gengatev1.GenerateRequest{}
			if err := protojson.Unmarshal([]byte(part.JsonLine), item); err != nil {
				refused[len(items)] = status.Errorf(codes.InvalidArgument, "requests[%d] is not a JSON request: %v", len(items), err)
			}
		default:
			return status.Error(codes.InvalidArgument, "only the first message is a header")
		}
		if header.GetDefaults() != nil && refused[len(items)] == nil {
			merged := proto.Clone(header.GetDefaults()).(*gengatev1.GenerateRequest)
			proto.Merge(merged, item)
			item = merged
		}
		items = append(items, item)
	}
	job := f.store(header, items, refused)
	f.ended("stored")
	return stream.SendAndClose(&gengatev1.UploadBatchJobResponse{Job: job})
}

func (f *fakeJobs) GetBatchJob(ctx context.Context, req *gengatev1.GetBatchJobRequest) (*gengatev1.GetBatchJobResponse, error) {
	f.called(ctx, "GetBatchJob")
	f.mu.Lock()
	defer f.mu.Unlock()
	job, err := f.findLocked(req.GetId())
	if err != nil {
		return nil, err
	}
	return &gengatev1.GetBatchJobResponse{Job: proto.Clone(job.job).(*gengatev1.BatchJob)}, nil
}

func (f *fakeJobs) ListBatchJobs(ctx context.Context, req *gengatev1.ListBatchJobsRequest) (*gengatev1.ListBatchJobsResponse, error) {
	f.called(ctx, "ListBatchJobs")
	f.mu.Lock()
	defer f.mu.Unlock()
	f.last.list = req
	size := int(req.GetPageSize())
	if size == 0 {
		size = 50
	}
	start := 0
	if req.GetPageToken() != "" {
		var err error
		if start, err = strconv.Atoi(req.GetPageToken()); err != nil {
			return nil, status.Error(codes.InvalidArgument, "bad page_token")
		}
	}
	out := &gengatev1.ListBatchJobsResponse{}
	for i := start; i < len(f.jobs) && i < start+size; i++ { // newest first
		out.Jobs = append(out.Jobs, proto.Clone(f.jobs[len(f.jobs)-1-i].job).(*gengatev1.BatchJob))
	}
	if start+size < len(f.jobs) {
		out.NextPageToken = strconv.Itoa(start + size)
	}
	return out, nil
}

func (f *fakeJobs) CancelBatchJob(ctx context.Context, req *gengatev1.CancelBatchJobRequest) (*gengatev1.CancelBatchJobResponse, error) {
	f.called(ctx, "CancelBatchJob")
	f.mu.Lock()
	defer f.mu.Unlock()
	job, err := f.findLocked(req.GetId())
	if err != nil {
		return nil, err
	}
	if finished(job.job.GetState()) {
		return nil, jobError(codes.FailedPrecondition, "JOB_FINISHED", "batch job "+job.job.GetId()+" has already ended")
	}
	cancelled := status.Convert(jobError(codes.Canceled, "JOB_CANCELLED", "the batch job was cancelled before this item finished")).Proto()
	for i, r := range job.results {
		if r == nil {
			job.results[i] = &gengatev1.StreamBatchJobResultsResponse{
				Index: uint64(i), Result: &gengatev1.StreamBatchJobResultsResponse_Error{Error: cancelled},
			}
			job.job.Done++
			job.job.Failed++
		}
	}
	job.job.State = gengatev1.BatchJobState_BATCH_JOB_STATE_CANCELLED
	f.notifyLocked()
	return &gengatev1.CancelBatchJobResponse{Job: proto.Clone(job.job).(*gengatev1.BatchJob)}, nil
}

func (f *fakeJobs) StreamBatchJobResults(req *gengatev1.StreamBatchJobResultsRequest, stream grpc.ServerStreamingServer[gengatev1.StreamBatchJobResultsResponse]) error {
	f.called(stream.Context(), "StreamBatchJobResults")
	f.mu.Lock()
	f.last.results = req
	f.mu.Unlock()
	next := uint64(0)
	if req.AfterIndex != nil {
		next = req.GetAfterIndex() + 1
	}
	for {
		f.mu.Lock()
		job, err := f.findLocked(req.GetId())
		if err != nil {
			f.mu.Unlock()
			return err
		}
		var ready []*gengatev1.StreamBatchJobResultsResponse
		for next < uint64(len(job.results)) && job.results[next] != nil {
			ready = append(ready, job.results[next])
			next++
		}
		done := next >= uint64(len(job.results))
		wait := f.changed
		f.mu.Unlock()
		for _, item := range ready {
			if err := stream.Send(item); err != nil {
				return err
			}
		}
		if done || !req.GetFollow() {
			return nil
		}
		select {
		case <-wait:
		case <-stream.Context().Done():
			return stream.Context().Err()
		}
	}
}
