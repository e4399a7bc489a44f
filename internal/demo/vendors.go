package demo

import (
	"net/http"
	"strings"
)

// Vendor is one entry of the vendors catalog.
type Vendor struct {
	ID         string `json:"id"`
	Name       string `json:"name"`
	Category   string `json:"category"`
	PriceCents int64  `json:"price_cents"` // per unit, USD
	LeadDays   int    `json:"lead_days"`
	Rating     string `json:"rating"` // "A" best to "C"
}

// VendorList is the answer to GET /v1/vendors.
type VendorList struct {
	Vendors []Vendor `json:"vendors"`
}

// catalog is the vendors service's fixed data.
var catalog = []Vendor{
	{ID: "acme-pumps", Name: "Acme Pumps", Category: "pumps", PriceCents: 41500, LeadDays: 5, Rating: "A"},
	{ID: "hydra-co", Name: "Hydra & Co", Category: "pumps", PriceCents: 38900, LeadDays: 21, Rating: "B"},
	{ID: "flowline", Name: "Flowline Supply", Category: "pumps", PriceCents: 45200, LeadDays: 3, Rating: "A"},
	{ID: "valvex", Name: "Valvex", Category: "valves", PriceCents: 2900, LeadDays: 7, Rating: "A"},
	{ID: "nordic-valve", Name: "Nordic Valve", Category: "valves", PriceCents: 3400, LeadDays: 2, Rating: "B"},
}

// NewVendors opens the vendors service, a pure one: a read-only catalog,
// which an agent's research tool can call any number of times. Its Stats
// count searches by category (Calls; Effects stays empty). Routes:
//
//	GET /v1/vendors?category=C  VendorList of category C (all without it)
func NewVendors(opts Options) (*Service, error) { return New(NameVendors, opts) }

type vendors struct{}

func (vendors) open(*Service, string) error { return nil }

// effectKey counts every search, under "category=<c>", so that a test
// sees how often a tool searched; a search has no effect.
func (vendors) effectKey(r *http.Request) (string, bool) {
	if r.URL.Path != "/v1/vendors" || r.Method != http.MethodGet {
		return "", false
	}
	return "category=" + strings.ToLower(strings.TrimSpace(r.URL.Query().Get("category"))), true
}

func (vendors) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/v1/vendors" {
		notFound(w, r)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		methodNotAllowed(w, "GET, HEAD")
		return
	}
	cat := strings.ToLower(strings.TrimSpace(r.URL.Query().Get("category")))
	out := VendorList{Vendors: []Vendor{}}
	for _, v := range catalog {
		if cat == "" || v.Category == cat {
			out.Vendors = append(out.Vendors, v)
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func (vendors) close() error { return nil }
