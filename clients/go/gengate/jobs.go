package gengate

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"iter"
	"strings"

	gengatev1 "github.com/gengate/gengate/clients/go/gen/gengate/v1"
)

// The generated batch job types, under shorter names.
type (
	BatchJob        = gengatev1.BatchJob
	BatchJobState   = gengatev1.BatchJobState
	BatchJobOptions = gengatev1.BatchJobOptions
)

// UploadAbove is the most requests Create sends in one CreateBatchJob message; a larger job
// goes with the client-streaming UploadBatchJob, one request a message.
const UploadAbove = 1000

// BatchJobs is the client of the BatchJobService (Client.BatchJobs): durable jobs stored and
// run by the server, whatever the caller does after creating one, with results read back in
// index order from any index.
type BatchJobs struct {
	c   *Client
	rpc gengatev1.BatchJobServiceClient
}

// BatchJobs returns the client's BatchJobService wrapper (same connection, options and metadata).
func (c *Client) BatchJobs() *BatchJobs { return c.jobs }

// Raw returns the generated BatchJobService client, for anything the wrapper does not cover.
func (j *BatchJobs) Raw() gengatev1.BatchJobServiceClient { return j.rpc }

// CreateOption configures BatchJobs.Create and CreateFromJSONL: a job setting (WithDisplayName,
// WithIdempotencyKey, WithOffline, WithPriority, WithMaxConcurrency, WithItemDefaults) or any
// CallOption.
type CreateOption interface{ applyCreate(*createConfig) }

type createConfig struct {
	header *gengatev1.BatchJobHeader
	call   []CallOption
}

type jobSetting func(*createConfig)

func (f jobSetting) applyCreate(c *createConfig) { f(c) }

func (o CallOption) applyCreate(c *createConfig) { c.call = append(c.call, o) }

// WithDisplayName names the job for people (not unique).
func WithDisplayName(name string) CreateOption {
	return jobSetting(func(c *createConfig) { c.header.DisplayName = name })
}

// WithIdempotencyKey makes a create retried with the same key return the first job instead of
// making another.
func WithIdempotencyKey(key string) CreateOption {
	return jobSetting(func(c *createConfig) { c.header.IdempotencyKey = key })
}

// WithOffline runs the job through the model's provider batch API: about half the price,
// results within a day.
func WithOffline() CreateOption {
	return jobSetting(func(c *createConfig) { c.header.Options.Offline = true })
}

// WithPriority runs the job before queued jobs of lower priority (default 0). Jobs always
// yield to interactive calls.
func WithPriority(priority int32) CreateOption {
	return jobSetting(func(c *createConfig) { c.header.Options.Priority = priority })
}

// WithMaxConcurrency caps the job's items in flight at once (0: the server's default).
func WithMaxConcurrency(n uint32) CreateOption {
	return jobSetting(func(c *createConfig) { c.header.Options.MaxConcurrency = n })
}

// WithItemDefaults gives the fields every item starts from (model, sampling, structured
// output...); an item's own fields override them. A job with defaults is always uploaded.
func WithItemDefaults(defaults *Request) CreateOption {
	return jobSetting(func(c *createConfig) { c.header.Defaults = defaults })
}

func newCreateConfig(opts []CreateOption) *createConfig {
	cfg := &createConfig{header: &gengatev1.BatchJobHeader{Options: &BatchJobOptions{}}}
	for _, opt := range opts {
		opt.applyCreate(cfg)
	}
	return cfg
}

// Create stores a job of reqs and returns it at once, queued: it runs on the server whatever
// this process does next. More than UploadAbove requests (or WithItemDefaults) go with the
// streaming upload; the job is the same.
func (j *BatchJobs) Create(ctx context.Context, reqs []*Request, opts ...CreateOption) (*BatchJob, error) {
	cfg := newCreateConfig(opts)
	if len(reqs) <= UploadAbove && cfg.header.GetDefaults() == nil {
		resp, err := j.rpc.CreateBatchJob(j.c.outgoing(ctx, cfg.call), &gengatev1.CreateBatchJobRequest{
			Requests:       reqs,
			DisplayName:    cfg.header.GetDisplayName(),
			IdempotencyKey: cfg.header.GetIdempotencyKey(),
			Options:        cfg.header.GetOptions(),
		})
		return resp.GetJob(), asError(err)
	}
	return j.upload(ctx, cfg, func(send func(*gengatev1.UploadBatchJobRequest) bool) error {
		for _, req := range reqs {
			if !send(&gengatev1.UploadBatchJobRequest{Part: &gengatev1.UploadBatchJobRequest_Request{Request: req}}) {
				return nil
			}
		}
		return nil
	})
}

// CreateFromJSONL uploads a job of JSONL lines read from r, parsed by the server: each line a
// JSON object of GenerateRequest fields (`prompt` as text, `messages` as {"role", "content"}
// objects), usually with WithItemDefaults for the model. Blank lines are skipped; a line the
// server cannot read is that item's INVALID_ARGUMENT, not the job's. If reading r fails, the
// upload is abandoned (cancelled: the server runs none of it) and the read error is returned.
func (j *BatchJobs) CreateFromJSONL(ctx context.Context, r io.Reader, opts ...CreateOption) (*BatchJob, error) {
	return j.upload(ctx, newCreateConfig(opts), func(send func(*gengatev1.UploadBatchJobRequest) bool) error {
		lines := bufio.NewReader(r)
		for {
			line, err := lines.ReadString('\n')
			if text := strings.TrimRight(line, "\r\n"); strings.TrimSpace(text) != "" {
				if !send(&gengatev1.UploadBatchJobRequest{Part: &gengatev1.UploadBatchJobRequest_JsonLine{JsonLine: text}}) {
					return nil
				}
			}
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return fmt.Errorf("gengate: reading the JSONL: %w", err)
			}
		}
	})
}

// upload sends the header then what items sends. send reports false once the server has ended
// the stream (its status comes from CloseAndRecv); an error of items abandons the upload.
func (j *BatchJobs) upload(ctx context.Context, cfg *createConfig, items func(send func(*gengatev1.UploadBatchJobRequest) bool) error) (*BatchJob, error) {
	ctx, cancel := context.WithCancel(j.c.outgoing(ctx, cfg.call))
	defer cancel()
	stream, err := j.rpc.UploadBatchJob(ctx)
	if err != nil {
		return nil, asError(err)
	}
	var sendErr error
	send := func(msg *gengatev1.UploadBatchJobRequest) bool {
		sendErr = stream.Send(msg)
		return sendErr == nil
	}
	if send(&gengatev1.UploadBatchJobRequest{Part: &gengatev1.UploadBatchJobRequest_Header{Header: cfg.header}}) {
		if err := items(send); err != nil {
			// Cancelled without a half-close: the server never sees the end of the upload,
			// so it runs none of the items sent so far.
			cancel()
			return nil, err
		}
	}
	if sendErr != nil && !isEOF(sendErr) {
		return nil, asError(sendErr)
	}
	resp, err := stream.CloseAndRecv()
	return resp.GetJob(), asError(err)
}

// Get says where a job stands: state, counts, times and usage so far. An unknown id is a
// NOT_FOUND *Error (reason JOB_NOT_FOUND).
func (j *BatchJobs) Get(ctx context.Context, id string, opts ...CallOption) (*BatchJob, error) {
	resp, err := j.rpc.GetBatchJob(j.c.outgoing(ctx, opts), &gengatev1.GetBatchJobRequest{Id: id})
	return resp.GetJob(), asError(err)
}

// List yields every job, newest first, fetching pageSize at a time (0: the server's default,
// 50). Breaking out of the loop fetches no further page.
func (j *BatchJobs) List(ctx context.Context, pageSize uint32, opts ...CallOption) iter.Seq2[*BatchJob, error] {
	return func(yield func(*BatchJob, error) bool) {
		ctx := j.c.outgoing(ctx, opts)
		token := ""
		for {
			page, err := j.rpc.ListBatchJobs(ctx, &gengatev1.ListBatchJobsRequest{PageSize: pageSize, PageToken: token})
			if err != nil {
				yield(nil, asError(err))
				return
			}
			for _, job := range page.GetJobs() {
				if !yield(job, nil) {
					return
				}
			}
			if token = page.GetNextPageToken(); token == "" {
				return
			}
		}
	}
}

// Cancel stops a job: its items not finished end with a CANCELLED error. Cancelling a job that
// has ended is a FAILED_PRECONDITION *Error (reason JOB_FINISHED).
func (j *BatchJobs) Cancel(ctx context.Context, id string, opts ...CallOption) (*BatchJob, error) {
	resp, err := j.rpc.CancelBatchJob(j.c.outgoing(ctx, opts), &gengatev1.CancelBatchJobRequest{Id: id})
	return resp.GetJob(), asError(err)
}

// JobResult is one item of a job: its response, or the item's own error.
type JobResult struct {
	// Index is the item's position in the job's requests; pass it as Results' afterIndex to
	// resume after it.
	Index    uint64
	Response *Response
	Err      *Error
}

// Results yields the job's finished items in index order, from the one after afterIndex (nil:
// from the first). With follow it waits for items still running, until the job's last item;
// without, it ends at the first item not finished. A failed item is a JobResult with Err set;
// only a failure of the stream itself (an unknown id: NOT_FOUND) yields an error. Breaking out
// of the loop cancels the stream.
func (j *BatchJobs) Results(ctx context.Context, id string, afterIndex *uint64, follow bool, opts ...CallOption) iter.Seq2[*JobResult, error] {
	return func(yield func(*JobResult, error) bool) {
		ctx, cancel := context.WithCancel(j.c.outgoing(ctx, opts))
		defer cancel()
		stream, err := j.rpc.StreamBatchJobResults(ctx, &gengatev1.StreamBatchJobResultsRequest{
			Id: id, AfterIndex: afterIndex, Follow: follow,
		})
		if err != nil {
			yield(nil, asError(err))
			return
		}
		recvAll(stream, func(item *gengatev1.StreamBatchJobResultsResponse, err error) bool {
			if err != nil {
				return yield(nil, err)
			}
			out := &JobResult{Index: item.GetIndex(), Response: item.GetResponse()}
			if st := item.GetError(); st != nil {
				out.Err = errorFromProto(st)
			}
			return yield(out, nil)
		})
	}
}
