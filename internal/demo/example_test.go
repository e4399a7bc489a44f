package demo_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"

	"github.com/waymark-dev/waymark/internal/demo"
)

// A retried request with the same Idempotency-Key files nothing new: the
// first answer comes back, marked replayed.
func ExampleStart() {
	dir, err := os.MkdirTemp("", "tickets")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	run, err := demo.Start(context.Background(), demo.NameTickets, demo.Options{Dir: dir})
	if err != nil {
		panic(err)
	}
	defer run.Close()
	tr := &http.Transport{DisableKeepAlives: true}
	client := &http.Client{Transport: tr}

	for range 2 {
		req, _ := http.NewRequest("POST", run.URL+"/v1/tickets/batch",
			strings.NewReader(`{"tickets": [{"report_id": "r-1", "title": "Disk full"}]}`))
		req.Header.Set(demo.IdempotencyKeyHeader, "job-1/file-tickets")
		resp, err := client.Do(req)
		if err != nil {
			panic(err)
		}
		var out demo.TicketBatchResponse
		_ = json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, resp.Header.Get(demo.ReplayedHeader), out.Tickets[0].ID)
	}
	s := run.Stats()
	fmt.Println("calls", s.Calls["job-1/file-tickets"], "effects", s.Effects["job-1/file-tickets"])
	// Output:
	// 201  WM-1001
	// 200 true WM-1001
	// calls 2 effects 1
}
