// monitoringcheck validates the Prometheus operator's objects in rendered manifests
// (monitoring.coreos.com/v1 ServiceMonitor, PodMonitor, PrometheusRule) against the operator's
// own Go API, github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring, for tests
// on a machine without a cluster, the operator or its CRDs:
//
//   - each object decoded strictly into its monitoringv1 type with sigs.k8s.io/json, as the API
//     server's strict field validation decodes (unknown and duplicate fields, a field name in the
//     wrong case and a value of the wrong type are errors, each naming its field);
//   - its metadata validated as the API server validates every custom resource's (name,
//     namespace, labels, annotations), with k8s.io/apimachinery's own validation;
//   - what the CRDs refuse that the Go types accept: the CRDs are generated from the types'
//     kubebuilder markers, and the few this checker enforces are copied, verbatim, in the
//     `markers` table below (required fields, duration patterns, enums, ranges, unique group
//     names); `monitoringcheck -markers` prints the table, and the tests check each line against
//     the module's source;
//   - what the operator refuses when it reconciles (a scrapeTimeout longer than the interval), and
//     what Prometheus' rule loader (model/rulefmt, which the operator runs on every
//     PrometheusRule) refuses: a rule with both or neither of alert and record, an empty expr,
//     annotations or for on a recording rule, alert labels and annotations that are not valid
//     Prometheus templates.
//
// PromQL itself is not parsed here (tests/deploy/promql.py checks the chart's expressions).
//
//	monitoringcheck [-namespace gengate] [FILE ...]   FILEs (none or "-": stdin), e.g. helmrender's output
//	monitoringcheck -markers                          the kubebuilder markers enforced, as JSON
//
// Other objects are skipped; finding no monitoring object at all is an error. Each object's
// result goes to stdout ("Kind/name: ok") or to stderr, one line per problem
// ("Kind/name: field.path: problem"); the exit status is 1 on any problem.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/template/parse"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"k8s.io/apimachinery/pkg/api/validation"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

const group = "monitoring.coreos.com"

// A kubebuilder marker of monitoringv1, copied from the module's source: Line is the marker's
// comment line verbatim (without "// "), found in the comment block right above Decl in File.
type marker struct {
	File string `json:"file"`
	Decl string `json:"decl"`
	Line string `json:"line"`
}

// markers: every CRD rule this checker enforces beyond the Go types, nothing else. The values
// the checks use (patterns, enums, bounds) are read from these lines, not written twice.
var markers = map[string]marker{
	"Duration":                          {"types.go", "type Duration string", `+kubebuilder:validation:Pattern:="^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"`},
	"NonEmptyDuration":                  {"types.go", "type NonEmptyDuration string", `+kubebuilder:validation:Pattern:="^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"`},
	"NonEmptyDuration.min":              {"types.go", "type NonEmptyDuration string", `+kubebuilder:validation:MinLength=1`},
	"Scheme":                            {"types.go", "type Scheme string", `+kubebuilder:validation:Enum=http;https;HTTP;HTTPS`},
	"ServiceMonitor.spec":               {"servicemonitor_types.go", "Spec ServiceMonitorSpec `json:\"spec\"`", `+required`},
	"ServiceMonitor.endpoints":          {"servicemonitor_types.go", "Endpoints []Endpoint `json:\"endpoints\"`", `+required`},
	"ServiceMonitor.selector":           {"servicemonitor_types.go", "Selector metav1.LabelSelector `json:\"selector\"`", `+required`},
	"PodMonitor.spec":                   {"podmonitor_types.go", "Spec PodMonitorSpec `json:\"spec\"`", `+required`},
	"PodMonitor.selector":               {"podmonitor_types.go", "Selector metav1.LabelSelector `json:\"selector\"`", `+required`},
	"PodMonitor.portNumber.min":         {"podmonitor_types.go", "PortNumber *int32 `json:\"portNumber,omitempty\"`", `+kubebuilder:validation:Minimum=1`},
	"PodMonitor.portNumber.max":         {"podmonitor_types.go", "PortNumber *int32 `json:\"portNumber,omitempty\"`", `+kubebuilder:validation:Maximum=65535`},
	"PrometheusRule.spec":               {"prometheusrule_types.go", "Spec PrometheusRuleSpec `json:\"spec\"`", `+required`},
	"RuleGroup.listType":                {"prometheusrule_types.go", "Groups []RuleGroup `json:\"groups,omitempty\"`", `+listType=map`},
	"RuleGroup.listMapKey":              {"prometheusrule_types.go", "Groups []RuleGroup `json:\"groups,omitempty\"`", `+listMapKey=name`},
	"RuleGroup.name":                    {"prometheusrule_types.go", "Name string `json:\"name\"`", `+required`},
	"RuleGroup.name.min":                {"prometheusrule_types.go", "Name string `json:\"name\"`", `+kubebuilder:validation:MinLength=1`},
	"RuleGroup.partialResponseStrategy": {"prometheusrule_types.go", "PartialResponseStrategy string `json:\"partial_response_strategy,omitempty\"`", `+kubebuilder:validation:Pattern="^(?i)(abort|warn)?$"`},
	"Rule.oneOf":                        {"prometheusrule_types.go", "type Rule struct {", `+kubebuilder:validation:OneOf=Record,Alert`},
	"Rule.expr":                         {"prometheusrule_types.go", "Expr intstr.IntOrString `json:\"expr\"`", `+required`},
}

// markerValue is what follows the marker's first "=": unquoted when it is a quoted pattern.
func markerValue(key string) string {
	line := markers[key].Line
	_, v, ok := strings.Cut(line, "=")
	if !ok {
		panic("marker without a value: " + line)
	}
	if u, err := strconv.Unquote(v); err == nil {
		return u
	}
	return v
}

func markerInt(key string) int64 {
	n, err := strconv.ParseInt(markerValue(key), 10, 64)
	if err != nil {
		panic(err)
	}
	return n
}

var (
	durationRE         = regexp.MustCompile(markerValue("Duration"))
	nonEmptyDurationRE = regexp.MustCompile(markerValue("NonEmptyDuration"))
	partialResponseRE  = regexp.MustCompile(markerValue("RuleGroup.partialResponseStrategy"))
	schemes            = strings.Split(markerValue("Scheme"), ";")
	durationPart       = regexp.MustCompile(`([0-9]+)(ms|y|w|d|h|m|s)`)
)

// Prometheus' model.ParseDuration units, for a duration that matched the Duration pattern.
var units = map[string]time.Duration{
	"ms": time.Millisecond, "s": time.Second, "m": time.Minute, "h": time.Hour,
	"d": 24 * time.Hour, "w": 7 * 24 * time.Hour, "y": 365 * 24 * time.Hour,
}

func parseDuration(s string) time.Duration {
	var d time.Duration
	for _, m := range durationPart.FindAllStringSubmatch(s, -1) {
		n, _ := strconv.ParseInt(m[1], 10, 64)
		d += time.Duration(n) * units[m[2]]
	}
	return d
}

func main() {
	namespace := flag.String("namespace", "default", "namespace for objects whose metadata names none (helm install sets the release's)")
	printMarkers := flag.Bool("markers", false, "print the kubebuilder markers this checker enforces, as JSON, and exit")
	flag.Parse()
	if *printMarkers {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(markers); err != nil {
			fail(err)
		}
		return
	}
	paths := flag.Args()
	if len(paths) == 0 {
		paths = []string{"-"}
	}
	checked, failed := 0, false
	for _, path := range paths {
		docs, err := readDocs(path)
		if err != nil {
			fail(err)
		}
		for i, doc := range docs {
			id, problems, err := checkDoc(doc, *namespace)
			switch {
			case err != nil:
				fmt.Fprintf(os.Stderr, "%s: document %d: %v\n", path, i, err)
				failed = true
			case id == "":
				continue // not a monitoring.coreos.com object
			case len(problems) > 0:
				for _, p := range problems {
					fmt.Fprintf(os.Stderr, "%s: %s\n", id, p)
				}
				failed = true
				checked++
			default:
				fmt.Printf("%s: ok\n", id)
				checked++
			}
		}
	}
	if checked == 0 && !failed {
		fail(errors.New("no ServiceMonitor, PodMonitor or PrometheusRule found"))
	}
	if failed {
		os.Exit(1)
	}
	fmt.Printf("%d monitoring object(s) checked\n", checked)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "Error:", err)
	os.Exit(1)
}

func readDocs(path string) ([][]byte, error) {
	var r io.Reader = os.Stdin
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		r = f
	}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(r))
	var docs [][]byte
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		docs = append(docs, doc)
	}
}

var sourceComment = regexp.MustCompile(`(?m)^# Source: (\S+)`)

// checkDoc returns "Kind/name" and its problems for a monitoring.coreos.com object, "" for any
// other document, or an error when the document is no Kubernetes object at all.
func checkDoc(doc []byte, namespace string) (string, []string, error) {
	js, dupErr := yaml.YAMLToJSONStrict(doc) // a key twice in a mapping: a problem of the object
	if dupErr != nil {
		var err error
		if js, err = yaml.YAMLToJSON(doc); err != nil {
			return "", nil, err
		}
	}
	if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
		return "", nil, nil // comments only
	}
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Name any `json:"name"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(js, &head); err != nil {
		return "", nil, fmt.Errorf("not an object: %w", err)
	}
	g, version, _ := strings.Cut(head.APIVersion, "/")
	if g != group {
		return "", nil, nil
	}
	name := head.Metadata.Name
	if name == nil {
		name = "(no name)"
	}
	id := fmt.Sprintf("%s/%v", head.Kind, name)
	if m := sourceComment.FindSubmatch(doc); m != nil {
		id += " (" + string(m[1]) + ")"
	}
	if version != "v1" {
		return id, []string{fmt.Sprintf("apiVersion: %s: only %s/v1 is checked", head.APIVersion, group)}, nil
	}
	var raw map[string]any
	if err := json.Unmarshal(js, &raw); err != nil {
		return "", nil, fmt.Errorf("not an object: %w", err)
	}
	var errs field.ErrorList
	var problems []string
	switch head.Kind {
	case monitoringv1.ServiceMonitorsKind:
		var o monitoringv1.ServiceMonitor
		problems = decodeStrict(js, &o)
		errs = append(errs, objectMeta(&o, namespace)...)
		errs = append(errs, serviceMonitor(raw, &o)...)
	case monitoringv1.PodMonitorsKind:
		var o monitoringv1.PodMonitor
		problems = decodeStrict(js, &o)
		errs = append(errs, objectMeta(&o, namespace)...)
		errs = append(errs, podMonitor(raw, &o)...)
	case monitoringv1.PrometheusRuleKind:
		var o monitoringv1.PrometheusRule
		problems = decodeStrict(js, &o)
		errs = append(errs, objectMeta(&o, namespace)...)
		errs = append(errs, prometheusRule(raw, &o)...)
	default:
		return id, []string{fmt.Sprintf("kind: %q: not checked by monitoringcheck", head.Kind)}, nil
	}
	for _, e := range errs {
		problems = append(problems, e.Error())
	}
	if dupErr != nil {
		problems = append([]string{strings.Join(strings.Fields(dupErr.Error()), " ")}, problems...)
	}
	return id, problems, nil
}

// decodeStrict decodes as the API server's strict field validation does (sigs.k8s.io/json:
// case-sensitive field names, unknown and duplicate fields reported with their path).
func decodeStrict(js []byte, into any) []string {
	var problems []string
	strict, err := sigsjson.UnmarshalStrict(js, into, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		problems = append(problems, err.Error()) // wrong types: "... Go struct field Endpoint.spec.endpoints.port of type string"
	}
	for _, e := range strict {
		problems = append(problems, e.Error()) // `unknown field "spec.endpoints[0].intervall"`
	}
	return problems
}

// objectMeta: the API server's validation of a custom resource's metadata (namespaced; the
// name a DNS subdomain; labels and annotations), after the namespace helm install would set.
func objectMeta(o metav1.Object, namespace string) field.ErrorList {
	if o.GetNamespace() == "" {
		o.SetNamespace(namespace)
	}
	return validation.ValidateObjectMetaAccessor(o, true, validation.NameIsDNSSubdomain, field.NewPath("metadata"))
}

// required reports keys a marker makes required that the document lacks (or sets to null). A
// missing parent is its own problem, reported once.
func required(raw map[string]any, key string, path ...string) field.ErrorList {
	m := raw
	p := (*field.Path)(nil)
	for i, k := range path {
		if p == nil {
			p = field.NewPath(k)
		} else {
			p = p.Child(k)
		}
		v, ok := m[k]
		if i == len(path)-1 {
			if !ok || v == nil {
				return field.ErrorList{field.Required(p, "the CRD requires it: "+markers[key].Line)}
			}
			return nil
		}
		if m, ok = v.(map[string]any); !ok {
			return nil
		}
	}
	return nil
}

func duration(p *field.Path, v string, re *regexp.Regexp, typ string) field.ErrorList {
	if re.MatchString(v) {
		return nil
	}
	return field.ErrorList{field.Invalid(p, v, fmt.Sprintf("not a Prometheus duration: must match %s (the CRD's pattern for monitoringv1.%s)", re, typ))}
}

// scrapeEndpoint: one ServiceMonitor endpoint's or PodMonitor endpoint's interval, scrapeTimeout
// and scheme.
func scrapeEndpoint(p *field.Path, interval, timeout monitoringv1.Duration, scheme *monitoringv1.Scheme) field.ErrorList {
	errs := duration(p.Child("interval"), string(interval), durationRE, "Duration")
	errs = append(errs, duration(p.Child("scrapeTimeout"), string(timeout), durationRE, "Duration")...)
	if scheme != nil && !slices.Contains(schemes, string(*scheme)) {
		errs = append(errs, field.NotSupported(p.Child("scheme"), string(*scheme), schemes))
	}
	// The operator's resource selector drops the monitor (validateScrapeIntervalAndTimeout).
	if len(errs) == 0 && interval != "" && timeout != "" && parseDuration(string(timeout)) > parseDuration(string(interval)) {
		errs = append(errs, field.Invalid(p.Child("scrapeTimeout"), string(timeout),
			fmt.Sprintf("longer than the interval %q: the Prometheus operator refuses the monitor (scrapeTimeout greater than scrapeInterval)", interval)))
	}
	return errs
}

func serviceMonitor(raw map[string]any, o *monitoringv1.ServiceMonitor) field.ErrorList {
	errs := required(raw, "ServiceMonitor.spec", "spec")
	errs = append(errs, required(raw, "ServiceMonitor.endpoints", "spec", "endpoints")...)
	errs = append(errs, required(raw, "ServiceMonitor.selector", "spec", "selector")...)
	for i, ep := range o.Spec.Endpoints {
		errs = append(errs, scrapeEndpoint(field.NewPath("spec", "endpoints").Index(i), ep.Interval, ep.ScrapeTimeout, ep.Scheme)...)
	}
	return errs
}

func podMonitor(raw map[string]any, o *monitoringv1.PodMonitor) field.ErrorList {
	errs := required(raw, "PodMonitor.spec", "spec")
	errs = append(errs, required(raw, "PodMonitor.selector", "spec", "selector")...)
	lo, hi := markerInt("PodMonitor.portNumber.min"), markerInt("PodMonitor.portNumber.max")
	for i, ep := range o.Spec.PodMetricsEndpoints {
		p := field.NewPath("spec", "podMetricsEndpoints").Index(i)
		errs = append(errs, scrapeEndpoint(p, ep.Interval, ep.ScrapeTimeout, ep.Scheme)...)
		if ep.PortNumber != nil && (int64(*ep.PortNumber) < lo || int64(*ep.PortNumber) > hi) {
			errs = append(errs, field.Invalid(p.Child("portNumber"), *ep.PortNumber, fmt.Sprintf("must be between %d and %d", lo, hi)))
		}
	}
	return errs
}

func prometheusRule(raw map[string]any, o *monitoringv1.PrometheusRule) field.ErrorList {
	errs := required(raw, "PrometheusRule.spec", "spec")
	groups := field.NewPath("spec", "groups")
	rawGroups, _ := nested(raw, "spec", "groups").([]any)
	seen := map[string]bool{}
	for i, g := range o.Spec.Groups {
		p := groups.Index(i)
		rawGroup, _ := index(rawGroups, i).(map[string]any)
		if rawGroup != nil {
			if v, ok := rawGroup["name"]; !ok || v == nil {
				errs = append(errs, field.Required(p.Child("name"), "the CRD requires it: "+markers["RuleGroup.name"].Line))
			}
		}
		if g.Name == "" {
			errs = append(errs, field.Invalid(p.Child("name"), g.Name, "must not be empty: "+markers["RuleGroup.name.min"].Line))
		} else if seen[g.Name] {
			// +listType=map, +listMapKey=name: the API server refuses a second group of the same name.
			errs = append(errs, field.Duplicate(p.Child("name"), g.Name))
		}
		seen[g.Name] = true
		if g.Interval != nil {
			errs = append(errs, duration(p.Child("interval"), string(*g.Interval), durationRE, "Duration")...)
		}
		if g.QueryOffset != nil {
			errs = append(errs, duration(p.Child("query_offset"), string(*g.QueryOffset), durationRE, "Duration")...)
		}
		if !partialResponseRE.MatchString(g.PartialResponseStrategy) {
			errs = append(errs, field.Invalid(p.Child("partial_response_strategy"), g.PartialResponseStrategy, "must match "+partialResponseRE.String()))
		}
		rawRules, _ := rawGroup["rules"].([]any)
		for j, r := range g.Rules {
			rawRule, _ := index(rawRules, j).(map[string]any)
			errs = append(errs, rule(p.Child("rules").Index(j), r, rawRule)...)
		}
	}
	return errs
}

// rule: the CRD's marker on expr, and Prometheus' rulefmt (RuleNode.Validate and its template
// check), whose messages these quote.
func rule(p *field.Path, r monitoringv1.Rule, raw map[string]any) field.ErrorList {
	var errs field.ErrorList
	name := r.Alert
	if name == "" {
		name = r.Record
	}
	in := func(e *field.Error) *field.Error {
		if name != "" {
			e.Detail = strings.TrimSpace(e.Detail + fmt.Sprintf(" (rule %q)", name))
		}
		return e
	}
	switch {
	case r.Alert != "" && r.Record != "":
		errs = append(errs, in(field.Invalid(p.Child("record"), r.Record, "only one of 'record' and 'alert' must be set (rulefmt)")))
	case r.Alert == "" && r.Record == "":
		errs = append(errs, field.Required(p.Child("alert"), "one of 'record' or 'alert' must be set (rulefmt)"))
	}
	if raw != nil {
		if v, ok := raw["expr"]; !ok || v == nil {
			errs = append(errs, in(field.Required(p.Child("expr"), "the CRD requires it: "+markers["Rule.expr"].Line)))
		} else if r.Expr.Type == intstr.String && strings.TrimSpace(r.Expr.StrVal) == "" {
			errs = append(errs, in(field.Required(p.Child("expr"), "field 'expr' must be set in rule (rulefmt)")))
		}
	}
	if r.For != nil {
		errs = append(errs, duration(p.Child("for"), string(*r.For), durationRE, "Duration")...)
	}
	if r.KeepFiringFor != nil {
		if *r.KeepFiringFor == "" {
			errs = append(errs, in(field.Invalid(p.Child("keep_firing_for"), "", "must not be empty: "+markers["NonEmptyDuration.min"].Line+" (monitoringv1.NonEmptyDuration)")))
		} else {
			errs = append(errs, duration(p.Child("keep_firing_for"), string(*r.KeepFiringFor), nonEmptyDurationRE, "NonEmptyDuration")...)
		}
	}
	if r.Record != "" {
		if len(r.Annotations) > 0 {
			errs = append(errs, in(field.Forbidden(p.Child("annotations"), "invalid field 'annotations' in recording rule (rulefmt)")))
		}
		if r.For != nil {
			errs = append(errs, in(field.Forbidden(p.Child("for"), "invalid field 'for' in recording rule (rulefmt)")))
		}
		if r.KeepFiringFor != nil {
			errs = append(errs, in(field.Forbidden(p.Child("keep_firing_for"), "invalid field 'keep_firing_for' in recording rule (rulefmt)")))
		}
		return errs
	}
	for _, kind := range []string{"labels", "annotations"} {
		values := r.Labels
		if kind == "annotations" {
			values = r.Annotations
		}
		for _, k := range slices.Sorted(maps.Keys(values)) {
			if err := alertTemplate(values[k]); err != nil {
				errs = append(errs, in(field.Invalid(p.Child(kind).Key(k), values[k], "not a Prometheus alert template: "+err.Error())))
			}
		}
	}
	return errs
}

// alertTemplate parses an alert's label or annotation value as Prometheus does before loading
// the rule (rulefmt.testTemplateParsing): Go text/template syntax after Prometheus' variable
// definitions, so a misspelt $variable or an unbalanced action fails. Function names are not
// checked (Prometheus' list is its own).
func alertTemplate(text string) error {
	const defs = "{{$labels := .Labels}}{{$externalLabels := .ExternalLabels}}{{$externalURL := .ExternalURL}}{{$value := .Value}}"
	t := parse.New("alert")
	t.Mode = parse.SkipFuncCheck
	_, err := t.Parse(defs+text, "{{", "}}", map[string]*parse.Tree{})
	return err
}

func nested(m map[string]any, keys ...string) any {
	var v any = m
	for _, k := range keys {
		mm, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = mm[k]
	}
	return v
}

func index(list []any, i int) any {
	if i < len(list) {
		return list[i]
	}
	return nil
}
