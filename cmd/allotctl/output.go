package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// This file renders every command's output. Table output goes through
// table (text/tabwriter); -o json renders protobuf messages with protojson
// (proto field names, every field present, 64-bit integers as numbers:
// jsonnum.go) re-indented so that the bytes are stable; -o yaml converts that JSON to YAML, keeping the field order.

// table writes aligned columns. Cells are sanitised: control characters
// (which could break the layout or drive the terminal) are quoted.
type table struct {
	tw *tabwriter.Writer
}

func newTable(w io.Writer, headers ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	if len(headers) > 0 {
		t.row(headers...)
	}
	return t
}

func (t *table) row(cells ...string) {
	for i, c := range cells {
		if i > 0 {
			io.WriteString(t.tw, "\t")
		}
		io.WriteString(t.tw, cell(c))
	}
	io.WriteString(t.tw, "\n")
}

func (t *table) flush() error { return t.tw.Flush() }

// cell makes s safe for one table cell: strings with control characters,
// tabs or invalid UTF-8 are Go-quoted; empty strings become "-".
func cell(s string) string {
	if s == "" {
		return "-"
	}
	for _, r := range s {
		if r == utf8.RuneError || unicode.IsControl(r) {
			return strconv.Quote(s)
		}
	}
	return s
}

// kv writes "Label:  value" lines, the values starting in column width
// (so that separate blocks of one output line up).
type kv struct {
	w     io.Writer
	width int
	err   error
}

func newKV(w io.Writer, width int) *kv { return &kv{w: w, width: width} }

func (k *kv) add(label, value string) {
	if k.err == nil {
		_, k.err = fmt.Fprintf(k.w, "%-*s%s\n", k.width, label+":", cell(value))
	}
}

func (k *kv) flush() error { return k.err }

var pjson = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}

// protoJSON renders m as indented JSON with stable bytes (protojson
// deliberately randomises whitespace; json.Indent normalises it).
func protoJSON(m proto.Message) ([]byte, error) {
	raw, err := pjson.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode json: %v", err)
	}
	if raw, err = numbersJSON(m.ProtoReflect(), raw); err != nil {
		return nil, fmt.Errorf("encode json: %v", err)
	}
	var buf bytes.Buffer
	if err := json.Indent(&buf, raw, "", "  "); err != nil {
		return nil, fmt.Errorf("encode json: %v", err)
	}
	buf.WriteByte('\n')
	return buf.Bytes(), nil
}

// plainJSON renders a Go value (for outputs that are not one protobuf
// message) as indented JSON.
func plainJSON(v any) ([]byte, error) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode json: %v", err)
	}
	return append(b, '\n'), nil
}

// jsonToYAML converts JSON to block-style YAML, keeping the key order.
func jsonToYAML(js []byte) ([]byte, error) {
	var n yaml.Node
	if err := yaml.Unmarshal(js, &n); err != nil {
		return nil, fmt.Errorf("encode yaml: %v", err)
	}
	clearStyle(&n)
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(&n); err != nil {
		return nil, fmt.Errorf("encode yaml: %v", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encode yaml: %v", err)
	}
	return buf.Bytes(), nil
}

func clearStyle(n *yaml.Node) {
	n.Style = 0
	for _, c := range n.Content {
		clearStyle(c)
	}
}

// writeProto renders m in the structured format (json or yaml).
func (a *app) writeProto(m proto.Message) error {
	js, err := protoJSON(m)
	if err != nil {
		return err
	}
	return a.writeStructured(js)
}

// writeValue renders a Go value in the structured format (json or yaml).
func (a *app) writeValue(v any) error {
	js, err := plainJSON(v)
	if err != nil {
		return err
	}
	return a.writeStructured(js)
}

func (a *app) writeStructured(js []byte) error {
	if a.output == "yaml" {
		y, err := jsonToYAML(js)
		if err != nil {
			return err
		}
		_, err = a.stdout.Write(y)
		return err
	}
	_, err := a.stdout.Write(js)
	return err
}

func (a *app) structured() bool { return a.output == "json" || a.output == "yaml" }

// fmtMS renders a duration in milliseconds for humans: 0s, 250ms, 1.5s,
// 2m5s, 3h20m, 2d4h. Negative durations render as "-".
func fmtMS(ms int64) string {
	if ms < 0 {
		return "-"
	}
	d := time.Duration(ms) * time.Millisecond
	switch {
	case ms == 0:
		return "0s"
	case ms < 1000:
		return fmt.Sprintf("%dms", ms)
	case d < 10*time.Second:
		return strings.TrimSuffix(fmt.Sprintf("%.1f", d.Seconds()), ".0") + "s"
	case d < time.Minute:
		return fmt.Sprintf("%ds", ms/1000)
	case d < time.Hour:
		m := int64(d / time.Minute)
		s := int64((d % time.Minute) / time.Second)
		if s == 0 {
			return fmt.Sprintf("%dm", m)
		}
		return fmt.Sprintf("%dm%ds", m, s)
	case d < 48*time.Hour:
		h := int64(d / time.Hour)
		m := int64((d % time.Hour) / time.Minute)
		if m == 0 {
			return fmt.Sprintf("%dh", h)
		}
		return fmt.Sprintf("%dh%dm", h, m)
	}
	days := int64(d / (24 * time.Hour))
	h := int64((d % (24 * time.Hour)) / time.Hour)
	if h == 0 {
		return fmt.Sprintf("%dd", days)
	}
	return fmt.Sprintf("%dd%dh", days, h)
}

// fmtAge renders how long before now (both Unix ms, the server's clock) an
// instant was: "1.5s ago". Zero instants render as "never".
func fmtAge(nowMS, thenMS int64) string {
	if thenMS == 0 {
		return "never"
	}
	if thenMS > nowMS {
		return "just now"
	}
	return fmtMS(nowMS-thenMS) + " ago"
}

// fmtRate renders a per-second rate with sensible precision.
func fmtRate(r float64) string {
	switch {
	case math.IsNaN(r) || math.IsInf(r, 0):
		return "-"
	case r == 0:
		return "0"
	case math.Abs(r) >= 100:
		return strconv.FormatFloat(r, 'f', 0, 64)
	case math.Abs(r) >= 1:
		return strconv.FormatFloat(r, 'f', 1, 64)
	}
	return strconv.FormatFloat(r, 'f', 2, 64)
}

// fmtUnixMS renders a server timestamp as RFC 3339 UTC (millisecond
// precision).
func fmtUnixMS(ms int64) string {
	if ms == 0 {
		return "-"
	}
	return time.UnixMilli(ms).UTC().Format("2006-01-02T15:04:05.000Z")
}

// fmtLimitShort renders a limit as "30/minute burst 10" (plus the
// algorithm when it is not the default and "shadow" in shadow mode).
func fmtLimitShort(l *allotv1.Limit) string {
	if l == nil {
		return "-"
	}
	if l.GetUnlimited() {
		return "unlimited"
	}
	s := fmt.Sprintf("%d/%s burst %d", l.GetRequestsPerUnit(), l.GetUnit(), l.GetBurst())
	if alg := l.GetAlgorithm(); alg != "" && alg != "token_bucket" {
		s += " " + alg
	}
	if l.GetShadowMode() {
		s += " shadow"
	}
	return s
}

// fmtLimitLong renders every parameter of a limit.
func fmtLimitLong(l *allotv1.Limit) string {
	if l == nil {
		return "-"
	}
	if l.GetUnlimited() {
		return "unlimited (always OK)"
	}
	parts := []string{
		fmt.Sprintf("%d/%s", l.GetRequestsPerUnit(), l.GetUnit()),
		fmt.Sprintf("burst %d", l.GetBurst()),
		orDash(l.GetAlgorithm()),
		"backend " + orDash(l.GetBackend()),
		"failure mode " + orDash(l.GetFailureMode()),
	}
	if r := l.GetRouting(); r != "" {
		parts = append(parts, "routing "+r)
	}
	if l.GetShards() > 1 {
		parts = append(parts, fmt.Sprintf("%d shards", l.GetShards()))
	}
	if l.GetShadowMode() {
		parts = append(parts, "SHADOW MODE (never denies)")
	}
	return strings.Join(parts, ", ")
}

// fmtRule renders a rule as "name (path)" or just the path when they agree.
func fmtRule(l *allotv1.Limit) string {
	if l == nil {
		return "-"
	}
	name, path := l.GetName(), l.GetRulePath()
	switch {
	case name == "" && path == "":
		return "-"
	case name == "" || name == path:
		return path
	case path == "":
		return name
	}
	return name + " (" + path + ")"
}

func fmtCode(c allotv1.Code) string {
	switch c {
	case allotv1.Code_CODE_OK:
		return "OK"
	case allotv1.Code_CODE_OVER_LIMIT:
		return "OVER_LIMIT"
	}
	return "UNKNOWN"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
