package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// protojson writes 64-bit integers as JSON strings ("tokens": "0"), as the
// proto3 JSON mapping says, which jq users trip on. numbersJSON rewrites
// those fields of m as JSON numbers, keeping the document's field order:
// raw is protojson's output for m, decoded into ordered values and walked
// alongside m's descriptors.

// jsonObject is a JSON object with its keys in document order.
type jsonObject struct {
	keys []string
	vals []any
}

func (o *jsonObject) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range o.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		kb, _ := json.Marshal(k)
		b.Write(kb)
		b.WriteByte(':')
		vb, err := json.Marshal(o.vals[i])
		if err != nil {
			return nil, err
		}
		b.Write(vb)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// decodeOrdered reads one JSON value: objects as *jsonObject, arrays as
// []any, numbers as json.Number.
func decodeOrdered(dec *json.Decoder) (any, error) {
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch d := tok.(type) {
	case json.Delim:
		switch d {
		case '{':
			o := &jsonObject{}
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				k, ok := kt.(string)
				if !ok {
					return nil, fmt.Errorf("object key %v", kt)
				}
				v, err := decodeOrdered(dec)
				if err != nil {
					return nil, err
				}
				o.keys, o.vals = append(o.keys, k), append(o.vals, v)
			}
			_, err := dec.Token() // '}'
			return o, err
		case '[':
			a := []any{}
			for dec.More() {
				v, err := decodeOrdered(dec)
				if err != nil {
					return nil, err
				}
				a = append(a, v)
			}
			_, err := dec.Token() // ']'
			return a, err
		}
		return nil, fmt.Errorf("unexpected %v", d)
	default:
		return tok, nil
	}
}

// numbersJSON returns raw (protojson of m, with proto field names) with
// every 64-bit integer field, singular, repeated or a map value, as a JSON
// number.
func numbersJSON(m protoreflect.Message, raw []byte) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeOrdered(dec)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("trailing data")
	}
	numbersIn(m, v)
	return json.Marshal(v)
}

func is64(k protoreflect.Kind) bool {
	switch k {
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind,
		protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return true
	}
	return false
}

// numbersIn rewrites, in v (m's decoded JSON), the strings of m's 64-bit
// integer fields as numbers. Well-known types (google.protobuf.*) have
// their own JSON forms and are left alone.
func numbersIn(m protoreflect.Message, v any) {
	o, ok := v.(*jsonObject)
	if !ok || strings.HasPrefix(string(m.Descriptor().FullName()), "google.protobuf.") {
		return
	}
	fields := m.Descriptor().Fields()
	for i, k := range o.keys {
		fd := fields.ByName(protoreflect.Name(k))
		if fd == nil {
			fd = fields.ByJSONName(k)
		}
		if fd == nil {
			continue
		}
		val := m.Get(fd)
		switch {
		case fd.IsList():
			a, _ := o.vals[i].([]any)
			l := val.List()
			for j := range a {
				if j >= l.Len() {
					break
				}
				a[j] = numberValue(fd, l.Get(j), a[j])
			}
		case fd.IsMap():
			mo, _ := o.vals[i].(*jsonObject)
			if mo == nil {
				continue
			}
			mp := val.Map()
			vd := fd.MapValue()
			mp.Range(func(mk protoreflect.MapKey, mv protoreflect.Value) bool {
				key := mk.String()
				for j, jk := range mo.keys {
					if jk == key {
						mo.vals[j] = numberValue(vd, mv, mo.vals[j])
					}
				}
				return true
			})
		default:
			o.vals[i] = numberValue(fd, val, o.vals[i])
		}
	}
}

// numberValue converts one value of field (or map value) fd.
func numberValue(fd protoreflect.FieldDescriptor, val protoreflect.Value, js any) any {
	switch {
	case is64(fd.Kind()):
		if s, ok := js.(string); ok {
			return json.Number(s)
		}
	case fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind:
		numbersIn(val.Message(), js)
	}
	return js
}
