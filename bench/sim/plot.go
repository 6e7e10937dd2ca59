package main

import (
	"fmt"
	"image/color"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// plotSpec is one PNG: admitted rate over time for several systems, with
// the limit (and, optionally, the offered rate) for reference.
type plotSpec struct {
	file   string
	title  string
	ylabel string
	lines  []plotLine
	marks  []float64 // vertical markers (seconds): events
}

type plotLine struct {
	name   string
	xs, ys []float64
	ref    bool // a reference line (limit, offered): drawn dashed in grey/black
	black  bool
}

// seriesLine turns per-bin counts into a rate line, averaged over
// smooth bins (a moving window) to keep Poisson noise readable.
func (w *world) seriesLine(name string, counts []int32, smooth int) plotLine {
	l := plotLine{name: name}
	smooth = max(smooth, 1)
	for i := 0; i+smooth <= len(counts); i += smooth {
		var s int64
		for j := i; j < i+smooth; j++ {
			s += int64(counts[j])
		}
		t := (float64(i) + float64(smooth)/2) * w.cfg.bin.Seconds()
		l.xs = append(l.xs, t)
		l.ys = append(l.ys, float64(s)/(float64(smooth)*w.cfg.bin.Seconds()))
	}
	return l
}

// sumSeries adds the series of several keys.
func sumSeries(ss ...[]int32) []int32 {
	if len(ss) == 0 {
		return nil
	}
	out := make([]int32, len(ss[0]))
	for _, s := range ss {
		for i, v := range s {
			out[i] += v
		}
	}
	return out
}

func flatLine(name string, from, to, y float64) plotLine {
	return plotLine{name: name, xs: []float64{from, to}, ys: []float64{y, y}, ref: true, black: true}
}

// write renders the plot into dir.
func (p *plotSpec) write(dir string) error {
	pl := plot.New()
	pl.Title.Text = p.title
	pl.X.Label.Text = "virtual time (s)"
	pl.Y.Label.Text = p.ylabel
	if p.ylabel == "" {
		pl.Y.Label.Text = "admitted (requests/s)"
	}
	pl.Legend.Top = true
	pl.Add(plotter.NewGrid())
	ci := 0
	for _, l := range p.lines {
		xy := make(plotter.XYs, len(l.xs))
		for i := range l.xs {
			xy[i].X, xy[i].Y = l.xs[i], l.ys[i]
		}
		ln, err := plotter.NewLine(xy)
		if err != nil {
			return fmt.Errorf("sim: plot %s: %w", p.file, err)
		}
		ln.Width = vg.Points(1.2)
		switch {
		case l.ref && l.black:
			ln.Color = color.Black
			ln.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		case l.ref:
			ln.Color = color.Gray{Y: 150}
			ln.Dashes = []vg.Length{vg.Points(2), vg.Points(2)}
		default:
			// Distinct colours and dashes: systems that admit the same
			// traffic draw on top of each other.
			ln.Color = plotutil.Color(ci)
			ln.Dashes = plotutil.Dashes(ci)
			ln.Width = vg.Points(1.6)
			ci++
		}
		pl.Add(ln)
		pl.Legend.Add(l.name, ln)
	}
	pl.Y.Min = 0
	top := 0.0
	for _, l := range p.lines {
		for _, y := range l.ys {
			top = max(top, y)
		}
	}
	pl.Y.Max = 1.3 * top // headroom for the legend
	if len(p.marks) > 0 {
		pl.Add(markers{xs: p.marks})
	}
	return pl.Save(9*vg.Inch, 4.5*vg.Inch, filepath.Join(dir, p.file))
}

// markers draws vertical lines at event times across the data area.
type markers struct{ xs []float64 }

func (m markers) Plot(c draw.Canvas, p *plot.Plot) {
	trX, _ := p.Transforms(&c)
	sty := draw.LineStyle{Color: color.RGBA{R: 200, G: 60, B: 60, A: 255}, Width: vg.Points(0.8),
		Dashes: []vg.Length{vg.Points(1), vg.Points(2)}}
	for _, x := range m.xs {
		px := trX(x)
		c.StrokeLine2(sty, px, c.Min.Y, px, c.Max.Y)
	}
}

// keyPlot plots one tracked key: its offered rate (from ref's recorder),
// what every system admitted, and the limit.
func (w *world) keyPlot(file, title string, key int, ref *system, limit float64) plotSpec {
	p := plotSpec{file: file, title: title}
	p.lines = append(p.lines, w.seriesLine("offered", ref.rec.offer[key], 5))
	p.lines[0].ref = true
	for _, s := range w.systems {
		p.lines = append(p.lines, w.seriesLine(s.name, s.rec.tracked[key], 5))
	}
	p.lines = append(p.lines, flatLine("limit R", 0, float64(w.end-epoch)/1e9, limit))
	return p
}
